"""Alembic environment: runs revisions against the URL set by ``scheduler.infra.db.migrate``."""

from __future__ import annotations

from alembic import context
from sqlalchemy import pool

from scheduler.infra.db import make_engine, process_timeouts
from scheduler.jobs.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    assert url, "sqlalchemy.url is not set (use scheduler.infra.db.migrate(url))"
    # No statement_timeout: a revision may rewrite a large table.
    engine = make_engine(url, timeouts=process_timeouts().for_migrations())
    engine.pool = pool.NullPool(engine.pool._creator)  # one short-lived connection
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
