"""Expiry runs in bounded batches, each its own transaction (issue 32 part 5).

One UPDATE over every due row ran into the 30 s statement timeout on a backlog and rolled back the
same way on every tick. Now ``scheduler/maintenance/tasks.py`` ``expire_finished_jobs`` updates at
most ``CLOVERQ_EXPIRY_BATCH`` rows per statement, commits each batch, and loops until none is due.
Checked through the beat's task (``cloverq.expire``) with a small batch, on both backends: every
UPDATE is bounded by the setting, each is committed before the next starts, none lifts the
statement timeout, and together they expire more rows than one batch holds (and nothing else).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import event, func, select

from scheduler.infra.db import make_engine, session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job, utcnow
from tests.integration.job_rows import insert_rows, job_row

pytestmark = pytest.mark.integration

BATCH, DUE = 20, 50  # three statements: 20, 20, 10


def test_expiry_task_expires_a_backlog_in_bounded_committed_batches(
    fresh_db_url: str, redis_client: redis_lib.Redis, make_settings: Callable[..., Settings],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from scheduler.maintenance import tasks

    settings = make_settings(database_url=fresh_db_url, expiry_batch=BATCH)
    engine = make_engine(fresh_db_url)
    sessions = session_factory(engine)
    past, future = utcnow() - timedelta(hours=1), utcnow() + timedelta(hours=1)
    with sessions() as session:
        insert_rows(session, [job_row(status=status, expires_at=past)
                              for i in range(DUE) for status in [("succeeded", "failed", "cancelled")[i % 3]]]
                    + [job_row(expires_at=future) for _ in range(5)]  # not due yet
                    + [job_row(status="running", finished_at=None, expires_at=past) for _ in range(5)])

    trail: list[str] = []  # "update:<rows>" and "commit", in order
    statements: list[str] = []

    def after_execute(_conn: Any, cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)
        if "UPDATE JOBS SET" in statement.upper():  # PostgreSQL: WITH expiring AS (...) UPDATE
            trail.append(f"update:{cursor.rowcount}")

    event.listen(engine, "after_cursor_execute", after_execute)
    event.listen(engine, "commit", lambda _conn: trail.append("commit"))
    monkeypatch.setattr(tasks, "_resources", lambda: (sessions(), redis_client, settings))
    try:
        assert tasks.expire_task() == DUE
    finally:
        event.remove(engine, "after_cursor_execute", after_execute)

    updates = [int(step.split(":")[1]) for step in trail if step.startswith("update:")]
    assert updates == [BATCH, BATCH, DUE - 2 * BATCH], trail  # bounded by the setting, looped until done
    for i, step in enumerate(trail):  # each batch committed before the next statement
        if step.startswith("update:"):
            assert trail[i + 1] == "commit", trail
    assert not [s for s in statements if "statement_timeout" in s.lower()]  # each batch stays under it
    with sessions() as session:
        by_status = dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())
        assert by_status == {"expired": DUE, "succeeded": 5, "running": 5}
        payloads = session.execute(select(Job.input, Job.result).where(Job.status == "expired")).all()
        assert {tuple(row) for row in payloads} == {(None, None)}  # dropped with the status change
    engine.dispose()
