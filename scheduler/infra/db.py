"""Database engine, sessions and migrations (PostgreSQL in production, SQLite embedded).

The schema is owned by Alembic (``migrations/``); nothing calls ``create_all``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from sqlalchemy import CursorResult, Engine, Result, create_engine, event, make_url, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

from scheduler.infra.settings import Settings, get_settings

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"  # the repository root's migrations/


def rowcount(result: Result[Any]) -> int:
    """The rows an ``UPDATE`` / ``DELETE`` matched. ``Session.execute`` is typed to answer a
    ``Result``; for those statements it is a ``CursorResult``, which has ``rowcount``."""
    return cast("CursorResult[Any]", result).rowcount


def dialect_insert(session: Session) -> Callable[..., Any]:
    """The ``insert`` of the session's backend, for ``ON CONFLICT`` (both backends have it; the
    generic ``insert`` does not)."""
    return postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert


def redact_url(url: str) -> str:
    """A database URL fit to print: its password, if any, replaced by ``***``."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    credentials, host = rest.rsplit("@", 1)
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in credentials else url


def lift_statement_timeout(session: Session) -> None:
    """No statement bound for the rest of ``session``'s transaction (PostgreSQL ``SET LOCAL``):
    for one statement over an unbounded set of rows (moving a canary's queued pins), which must
    finish rather than fail the same way on every try. Where the work can be split, split it
    instead (expiry runs in bounded batches: ``scheduler/maintenance/tasks.py``)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SET LOCAL statement_timeout = 0"))


@dataclass(frozen=True, slots=True)
class DatabaseTimeouts:
    """Every bound a database call can wait under, so no path hangs on a silent server (issue 16).

    ``connect``: opening one connection (libpq counts whole seconds, at least 2). ``statement``:
    PostgreSQL ``statement_timeout`` (0: none). ``lock``: PostgreSQL ``lock_timeout`` (0: none)
    and SQLite's busy timeout. ``pool``: waiting for a free pooled connection. A server that
    accepts TCP and then never answers is caught by ``connect``; a slow query or a lock wait by
    the server-side timeouts. A server that wedges in the middle of a query is not bounded here
    (psycopg has no client-side read timeout): ``/readyz`` still answers within its own deadline.
    """

    connect: float = 5.0
    statement: float = 30.0
    lock: float = 30.0
    pool: float = 10.0

    @classmethod
    def from_settings(cls, settings: Settings) -> DatabaseTimeouts:
        """The bounds ``settings`` configure (``CLOVERQ_DATABASE_*_TIMEOUT_SECONDS``)."""
        return cls(
            connect=settings.database.connect_timeout_seconds,
            statement=settings.database.statement_timeout_seconds,
            lock=settings.database.lock_timeout_seconds,
            pool=settings.database.pool_timeout_seconds,
        )

    def for_migrations(self) -> DatabaseTimeouts:
        """No statement bound: a migration may rewrite a large table (connecting stays bounded)."""
        return dataclasses.replace(self, statement=0.0)


def process_timeouts() -> DatabaseTimeouts:
    """The bounds of this process's settings (what ``make_engine`` uses when given none)."""
    return DatabaseTimeouts.from_settings(get_settings())


def _milliseconds(seconds: float) -> int:
    return max(0, round(seconds * 1000))


def postgres_connect_args(timeouts: DatabaseTimeouts) -> dict[str, Any]:
    """psycopg connect arguments: libpq's ``connect_timeout`` (whole seconds, rounded up)."""
    return {"connect_timeout": max(2, math.ceil(timeouts.connect))}


def postgres_session_sql(timeouts: DatabaseTimeouts) -> str:
    """The ``SET`` run once on every new PostgreSQL connection.

    A ``SET`` after connecting rather than the ``options`` startup parameter: PgBouncer refuses
    unknown startup parameters, and ``options`` in connect args would replace one given in the URL.
    """
    return (f"SET statement_timeout = {_milliseconds(timeouts.statement)}; "
            f"SET lock_timeout = {_milliseconds(timeouts.lock)}")


def _postgres_session_setup(timeouts: DatabaseTimeouts) -> Callable[[Any, Any], None]:
    sql = postgres_session_sql(timeouts)

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Autocommit for the SET, so it is not rolled back with the pool's first reset.
        autocommit = dbapi_connection.autocommit
        dbapi_connection.autocommit = True
        try:
            with dbapi_connection.cursor() as cursor:
                cursor.execute(sql)
        finally:
            dbapi_connection.autocommit = autocommit

    return on_connect


def _sqlite_pragmas(busy_timeout_ms: int) -> Callable[[Any, Any], None]:
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        # WAL lets the API read while a worker writes; busy_timeout turns lock contention into
        # bounded waits.
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return on_connect


def make_engine(
    url: str, *, pool_size: int = 10, echo: bool = False, timeouts: DatabaseTimeouts | None = None
) -> Engine:
    """A SQLAlchemy engine for ``url`` with settings that suit a job system on either backend.

    ``timeouts`` default to this process's settings; every connection honours them.
    """
    timeouts = timeouts or process_timeouts()
    if url.startswith("sqlite"):
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, echo=echo, connect_args={"check_same_thread": False, "timeout": timeouts.lock}
        )
        event.listen(engine, "connect", _sqlite_pragmas(_milliseconds(timeouts.lock)))
        return engine
    postgres = make_url(url).get_backend_name() == "postgresql"
    engine = create_engine(
        url, echo=echo, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True,
        pool_timeout=timeouts.pool, connect_args=postgres_connect_args(timeouts) if postgres else {},
    )
    if postgres:
        event.listen(engine, "connect", _postgres_session_setup(timeouts))
    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes after commit (rows are handed to callers)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def alembic_config(url: str) -> Any:
    """An Alembic ``Config`` for ``url`` that works from any working directory."""
    from alembic.config import Config  # deferred: alembic (~0.1 s) is for migrations and the start check

    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def migrate(url: str, *, revision: str = "head") -> None:
    """Upgrade the database at ``url`` to ``revision`` (idempotent)."""
    from alembic import command  # deferred: alembic (~0.1 s) is for migrations and the start check

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
