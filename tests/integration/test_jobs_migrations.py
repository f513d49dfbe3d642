"""Migrations: ``scheduler.infra.db.migrate`` works from any directory, revision 0001_jobs creates the
``jobs`` table, and the head revision (0007_canary added ``routed_version``, 0011_job_trace
``trace_id`` and ``trace_span_id``) leaves exactly the ``jobs`` table the model describes (no
drift between the ORM and Alembic); 0008_operator_state adds the ``operator_state`` table of
``scheduler.fleet.operator_state``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from scheduler.infra.db import make_engine, migrate
from scheduler.jobs.models import Base

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_migrate_from_another_directory_reaches_0001_without_drift(empty_db_url: str, tmp_path: Path) -> None:
    code = f"from scheduler.infra.db import migrate; migrate({empty_db_url!r}, revision='0001_jobs')"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, timeout=120)
    engine = make_engine(empty_db_url)
    try:
        with engine.connect() as conn:
            assert MigrationContext.configure(conn).get_current_revision() == "0001_jobs"
            diffs = [d for d in compare_metadata(MigrationContext.configure(conn), Base.metadata)
                     if _touches_jobs(d) and not _added_later(d)]
        assert diffs == []
        migrate(empty_db_url)  # head: the columns added to ``jobs`` later are there
        with engine.connect() as conn:
            columns = [d for d in compare_metadata(MigrationContext.configure(conn), Base.metadata)
                       if _touches_jobs(d) and not isinstance(d, list) and "column" in d[0]]
        assert columns == []
        indexes = {ix["name"] for ix in inspect(engine).get_indexes("jobs")}
        assert {"ix_jobs_tenant_created", "ix_jobs_status_available", "ix_jobs_status_lease"} <= indexes
    finally:
        engine.dispose()


LATER_JOBS_COLUMNS = {"routed_version",  # added by 0007_canary
                      "trace_id", "trace_span_id",  # added by 0011_job_trace
                      "scheduled_for", "webhook_events",  # added by 0013_schedule_and_webhook_events
                      "retention_seconds", "purge_at", "purged_at"}  # added by 0014_retention


LATER_JOBS_INDEXES = {"ix_jobs_status_scheduled",  # added by 0013_schedule_and_webhook_events
                      "ix_jobs_purge_due", "ix_jobs_purge_pending",  # added by 0014_retention
                      "ix_jobs_routed_version"}  # added by 0015_routed_version_index


# jsonb at 0001_jobs, json from 0016_json_keeps_key_order on (PostgreSQL; SQLite had json throughout)
RETYPED_LATER_JOBS_COLUMNS = {"input", "params", "metadata", "progress", "result"}


def _added_later(diff: object) -> bool:
    """An ``add_column`` (``add_index``) of a ``jobs`` column (index) that a revision after
    0001_jobs adds, or the ``modify_type`` of a column a later revision retypes."""
    if isinstance(diff, list):
        return all(item[0] == "modify_type" and item[3] in RETYPED_LATER_JOBS_COLUMNS for item in diff)
    return isinstance(diff, tuple) and (
        (diff[0] == "add_column" and getattr(diff[-1], "name", None) in LATER_JOBS_COLUMNS)
        or (diff[0] == "add_index" and getattr(diff[-1], "name", None) in LATER_JOBS_INDEXES))


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


def test_head_has_the_operator_state_table_of_the_model(empty_db_url: str) -> None:
    """0008_operator_state: the table matches ``OperatorSetting`` and carries the one-off
    ``adopt_redis`` row (scheduler/fleet/operator_state.py imports pre-0008 Redis state once)."""
    from sqlalchemy import select

    from scheduler.fleet.operator_state import ADOPT_REDIS, KIND_META, OperatorSetting

    migrate(empty_db_url)
    engine = make_engine(empty_db_url)
    try:
        with engine.connect() as conn:
            diffs = [d for d in compare_metadata(MigrationContext.configure(conn), Base.metadata)
                     if _touches_table(d, "operator_state")]
            rows = conn.execute(select(OperatorSetting.kind, OperatorSetting.name)).all()
        assert diffs == []
        assert [tuple(row) for row in rows] == [(KIND_META, ADOPT_REDIS)]
    finally:
        engine.dispose()


def _touches_table(diff: object, table_name: str) -> bool:
    items = diff if isinstance(diff, list) else [diff]
    for item in items:
        for part in item:
            table = getattr(part, "table", None)
            if part == table_name or getattr(part, "name", None) == table_name \
                    or (table is not None and table.name == table_name):
                return True
    return False
