"""Every database connection carries bounded timeouts (issue 16); the rules, without a server."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text

from scheduler.infra.db import DatabaseTimeouts, make_engine, postgres_connect_args, postgres_session_sql
from scheduler.infra.settings import Settings


def test_timeouts_come_from_the_settings() -> None:
    settings = Settings(database_connect_timeout_seconds=3, database_statement_timeout_seconds=12.5,
                        database_lock_timeout_seconds=4, database_pool_timeout_seconds=6)
    expected = DatabaseTimeouts(connect=3, statement=12.5, lock=4, pool=6)
    assert DatabaseTimeouts.from_settings(settings) == expected
    assert DatabaseTimeouts.from_settings(settings).for_migrations().statement == 0


def test_postgres_connect_timeout_is_whole_seconds_and_at_least_two() -> None:
    assert postgres_connect_args(DatabaseTimeouts(connect=0.5)) == {"connect_timeout": 2}
    assert postgres_connect_args(DatabaseTimeouts(connect=5.2)) == {"connect_timeout": 6}


def test_postgres_sessions_set_statement_and_lock_timeouts_in_milliseconds() -> None:
    sql = postgres_session_sql(DatabaseTimeouts(statement=30, lock=0.25))
    assert sql == "SET statement_timeout = 30000; SET lock_timeout = 250"
    assert "statement_timeout = 0;" in postgres_session_sql(DatabaseTimeouts(statement=0))  # 0: none


def test_sqlite_busy_timeout_is_the_lock_timeout(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}", timeouts=DatabaseTimeouts(lock=1.5))
    try:
        with engine.connect() as connection:
            assert connection.scalar(text("PRAGMA busy_timeout")) == 1500
    finally:
        engine.dispose()
