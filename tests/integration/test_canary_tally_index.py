"""The canary gate's tally reads an index, not the whole ``jobs`` table (issue 32 part 5).

Migration ``0015_routed_version_index`` adds ``ix_jobs_routed_version`` (partial: pinned jobs
only). Checked on both backends after ``migrate``: the index is there with its columns and
predicate, and the planner picks it for ``scheduler/model_versions/canary_gate.py`` ``tally``'s
query over a table where most jobs are unpinned (as they are in production).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, inspect, select, text
from sqlalchemy.orm import Session

from scheduler.infra.db import make_engine, session_factory
from scheduler.jobs.models import Job, utcnow
from scheduler.model_versions.canary_gate import COUNTED, tally
from tests.integration.job_rows import insert_rows, job_row

pytestmark = pytest.mark.integration

INDEX = "ix_jobs_routed_version"
UNPINNED, PINNED_EACH = 3000, 40


def _plan(session: Session, since: object) -> str:
    """The backend's plan for the tally's query (the statement ``tally`` runs, literal values)."""
    query = (select(Job.routed_version, Job.status, func.count())
             .where(Job.routed_version.in_(["canary-v2", "stable-v1"]), Job.status.in_(COUNTED),
                    Job.created_at >= since)
             .group_by(Job.routed_version, Job.status))
    bind = session.get_bind()
    sql = str(query.compile(bind, compile_kwargs={"literal_binds": True}))
    if bind.dialect.name == "postgresql":
        return "\n".join(session.execute(text(f"EXPLAIN {sql}")).scalars())
    return "\n".join(str(row[-1]) for row in session.execute(text(f"EXPLAIN QUERY PLAN {sql}")))


def test_the_tally_query_uses_the_routed_version_index(fresh_db_url: str) -> None:
    engine = make_engine(fresh_db_url)
    try:
        indexes = {ix["name"]: ix for ix in inspect(engine).get_indexes("jobs")}
        assert INDEX in indexes, sorted(indexes)
        assert indexes[INDEX]["column_names"] == ["routed_version", "status", "created_at"]
        since = utcnow() - timedelta(hours=1)
        with session_factory(engine)() as session:
            definition = ("SELECT indexdef FROM pg_indexes WHERE indexname = :name"
                          if engine.dialect.name == "postgresql"
                          else "SELECT sql FROM sqlite_master WHERE type = 'index' AND name = :name")
            predicate = session.execute(text(definition), {"name": INDEX}).scalar_one()
            assert "routed_version IS NOT NULL" in predicate  # partial: unpinned jobs are not in it
            rows = [job_row() for _ in range(UNPINNED)]
            rows += [job_row(routed_version=version, status=status)
                     for version in ("canary-v2", "stable-v1") for status in ("succeeded", "failed")
                     for _ in range(PINNED_EACH // 2)]
            insert_rows(session, rows)
            session.execute(text("ANALYZE"))
            session.commit()
            plan = _plan(session, since)
            assert INDEX in plan, plan
            tallies = tally(session, versions=["canary-v2", "stable-v1"], since=since)
        assert {v: (t.finished, t.failed) for v, t in tallies.items()} == {
            "canary-v2": (PINNED_EACH, PINNED_EACH // 2), "stable-v1": (PINNED_EACH, PINNED_EACH // 2)}
    finally:
        engine.dispose()
