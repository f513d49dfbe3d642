"""Migrations: ``scheduler.db.migrate`` works from any directory, and revision 0001_jobs creates
exactly the ``jobs`` table the model describes (no drift between the ORM and Alembic)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from scheduler.db import make_engine
from scheduler.models import Base

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fresh.db'}"
        return
    base = os.environ.get("CLOVERQ_TEST_DATABASE_URL", "")
    if not base.startswith("postgresql"):
        pytest.skip("no PostgreSQL configured (set CLOVERQ_TEST_DATABASE_URL)")
    from tests.conftest import _create_postgres_database

    url, drop = _create_postgres_database(base)
    yield url
    drop()


def test_migrate_from_another_directory_reaches_0001_without_drift(fresh_url: str, tmp_path: Path) -> None:
    code = f"from scheduler.db import migrate; migrate({fresh_url!r}, revision='0001_jobs')"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, timeout=120)
    engine = make_engine(fresh_url)
    try:
        with engine.connect() as conn:
            assert MigrationContext.configure(conn).get_current_revision() == "0001_jobs"
            diffs = [d for d in compare_metadata(MigrationContext.configure(conn), Base.metadata)
                     if _touches_jobs(d)]
        assert diffs == []
        indexes = {ix["name"] for ix in inspect(engine).get_indexes("jobs")}
        assert {"ix_jobs_tenant_created", "ix_jobs_status_available", "ix_jobs_status_lease"} <= indexes
    finally:
        engine.dispose()


def _touches_jobs(diff: object) -> bool:
    """Alembic diff entries are tuples (or lists of tuples) naming tables/columns/indexes."""
    items = diff if isinstance(diff, list) else [diff]
    for item in items:
        for part in item:
            table = getattr(part, "table", None)
            name = getattr(part, "name", None)
            if part == "jobs" or name == "jobs" or (table is not None and table.name == "jobs"):
                return True
    return False
