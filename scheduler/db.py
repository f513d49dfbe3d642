"""Database engine, sessions and migrations (PostgreSQL in production, SQLite embedded).

The schema is owned by Alembic (``migrations/``); nothing calls ``create_all``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets the API read while a worker writes; busy_timeout turns lock contention into waits.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def make_engine(url: str, *, pool_size: int = 10, echo: bool = False) -> Engine:
    """A SQLAlchemy engine for ``url`` with settings that suit a job system on either backend."""
    if url.startswith("sqlite"):
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, echo=echo, connect_args={"check_same_thread": False, "timeout": 30}
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(
        url, echo=echo, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True
    )


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes after commit (rows are handed to callers)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def alembic_config(url: str) -> Any:
    """An Alembic ``Config`` for ``url`` that works from any working directory."""
    from alembic.config import Config

    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def migrate(url: str, *, revision: str = "head") -> None:
    """Upgrade the database at ``url`` to ``revision`` (idempotent)."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


_factories: dict[str, sessionmaker[Session]] = {}


def get_session_factory(url: str) -> sessionmaker[Session]:
    """The process-wide session factory for ``url`` (one engine/pool per URL per process)."""
    factory = _factories.get(url)
    if factory is None:
        factory = _factories[url] = session_factory(make_engine(url))
    return factory


def dispose_all() -> None:
    """Close every process-wide engine (tests, shutdown)."""
    for factory in _factories.values():
        bind = factory.kw.get("bind")
        if bind is not None:
            bind.dispose()
    _factories.clear()
