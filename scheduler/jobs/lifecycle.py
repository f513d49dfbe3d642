"""Fenced state transitions of a running job (docs/architecture.md §3.2).

A worker claims a job with one conditional UPDATE (``queued -> running``, ``attempt + 1``,
lease) and every later write is guarded by ``(id, attempt, status='running')``. A duplicate or
redelivered message therefore either finds nothing to claim or writes nothing: one outcome.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, bindparam, or_, select, update
from sqlalchemy.orm import Session

from scheduler.infra.db import rowcount
from scheduler.infra.settings import Settings
from scheduler.jobs.models import ErrorCode, Job, JobStatus, utcnow
from scheduler.jobs.retry import backoff_seconds

jobs_table = cast(Table, Job.__table__)  # a Table (mapped classes type it as FromClause)

# ``available_at`` is written by other hosts' clocks (API, beat, other workers); a worker whose
# clock lags a little must still take a freshly submitted job rather than skip it.
CLOCK_SKEW_TOLERANCE = timedelta(seconds=1)


def sql_safe_text(text: str) -> str:
    """``text`` as the job's outcome stores it: NUL characters replaced (U+FFFD; see ``_sql_safe``).
    The worker's streamed deltas use it too, so that a stream adds up to the stored text."""
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


def _sql_safe(value: Any) -> Any:
    """``value`` with NUL characters replaced (U+FFFD) in every string, recursively.

    PostgreSQL cannot store U+0000 in ``text`` (``UntranslatableCharacter``; nor in ``jsonb``,
    which the JSON columns were before migration 0016), and a model can decode a token to it:
    without this an outcome write that reaches a text column fails and the job hangs in
    ``running`` until its lease expires; the stored text and the streamed deltas stay alike.
    """
    if isinstance(value, str):
        return sql_safe_text(value)
    if isinstance(value, dict):
        return {key: _sql_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_sql_safe(item) for item in value]
    return value


@dataclass(frozen=True)
class Lease:
    """What a worker holds after a successful claim."""

    job_id: uuid.UUID
    attempt: int


def claim_job(
    session: Session,
    *,
    job_id: uuid.UUID,
    worker_id: str,
    model_version: str | None,
    settings: Settings,
    now: datetime | None = None,
    served_version: str | None = None,
) -> Job | None:
    """Take a queued, due job; None when it is not claimable (duplicate, cancelled, not due, or
    pinned by a canary to another version than ``served_version``:
    scheduler/model_versions/canary_routing.py).

    The version check is part of the same conditional UPDATE, so a job re-pinned by a canary
    transition (``scheduler.model_versions.canary``) is either claimed under its old pin or its new one, never
    by a worker of a version it is not pinned to.
    """
    now = now or utcnow()
    pinned_ok = (Job.routed_version.is_(None) if served_version is None
                 else or_(Job.routed_version.is_(None), Job.routed_version == served_version))
    row = session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            Job.status == JobStatus.QUEUED.value,
            Job.cancel_requested.is_(False),
            Job.available_at <= now + CLOCK_SKEW_TOLERANCE,
            pinned_ok,
        )
        .values(
            status=JobStatus.RUNNING.value,
            attempt=Job.attempt + 1,
            lease_deadline=now + timedelta(seconds=settings.jobs.lease_seconds),
            worker_id=worker_id,
            model_version=model_version,
            started_at=now,
            updated_at=now,
        )
        .returning(Job)  # the claimed row in the same round trip (no SELECT after the commit)
        .execution_options(populate_existing=True)
    ).scalar_one_or_none()
    session.commit()
    return row


def finish_job(
    session: Session,
    *,
    lease: Lease,
    status: JobStatus,
    settings: Settings,
    result: dict[str, Any] | None = None,
    steps_used: int | None = None,
    error_code: str | None = None,
    error_message: str | None = None,
    progress: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> bool:
    """Write the outcome of the attempt in ``lease``; False when the attempt no longer owns the job."""
    assert status.is_final
    now = now or utcnow()
    values: dict[str, Any] = {
        "status": status.value,
        "result": _sql_safe(result),
        "error_code": error_code,
        "error_message": _sql_safe(error_message),
        "finished_at": now,
        "expires_at": now + timedelta(seconds=settings.jobs.result_ttl_seconds),
        "lease_deadline": None,
        "updated_at": now,
    }
    if steps_used is not None:
        values["steps_used"] = steps_used
    if progress is not None:
        values["progress"] = _sql_safe(progress)
    written = rowcount(session.execute(
        update(Job)
        .where(Job.id == lease.job_id, Job.attempt == lease.attempt, Job.status == JobStatus.RUNNING.value)
        .values(**values)
    ))
    session.commit()
    return written == 1


def retry_or_fail(
    session: Session,
    *,
    lease: Lease,
    error: str,
    settings: Settings,
    rng: random.Random | None = None,
    now: datetime | None = None,
) -> JobStatus | None:
    """After a transient fault: back to ``queued`` with backoff, or ``failed`` when attempts are spent.

    Returns the new status, or None when the attempt no longer owns the job.
    """
    now = now or utcnow()
    job = session.get(Job, lease.job_id, populate_existing=True)
    if job is None or job.attempt != lease.attempt or job.status != JobStatus.RUNNING.value:
        session.rollback()
        return None
    if lease.attempt >= job.max_attempts:
        done = finish_job(
            session, lease=lease, status=JobStatus.FAILED, settings=settings,
            error_code=ErrorCode.RETRIES_EXHAUSTED.value,
            error_message=f"failed {lease.attempt} attempts; last error: {error}"[:2000], now=now,
        )
        return JobStatus.FAILED if done else None
    delay = backoff_seconds(lease.attempt, settings, rng=rng)
    written = rowcount(session.execute(
        update(Job)
        .where(Job.id == lease.job_id, Job.attempt == lease.attempt, Job.status == JobStatus.RUNNING.value)
        .values(
            status=JobStatus.QUEUED.value,
            available_at=now + timedelta(seconds=delay),
            lease_deadline=None,
            worker_id=None,
            error_message=f"attempt {lease.attempt} failed: {error}"[:2000],
            updated_at=now,
        )
    ))
    session.commit()
    return JobStatus.QUEUED if written == 1 else None


@dataclass(frozen=True)
class LeaseCheck:
    """State of held leases after a renewal: which to stop (lost) and which to cancel."""

    lost: frozenset[uuid.UUID]
    cancel_requested: frozenset[uuid.UUID]


def renew_leases(
    session: Session,
    *,
    leases: Sequence[Lease],
    worker_id: str,
    settings: Settings,
    now: datetime | None = None,
) -> LeaseCheck:
    """Extend every lease this worker holds (one UPDATE) and report lost / cancel-flagged jobs."""
    if not leases:
        return LeaseCheck(frozenset(), frozenset())
    now = now or utcnow()
    ids = [lease.job_id for lease in leases]
    session.execute(
        update(Job)
        .where(Job.id.in_(ids), Job.worker_id == worker_id, Job.status == JobStatus.RUNNING.value)
        .values(lease_deadline=now + timedelta(seconds=settings.jobs.lease_seconds), updated_at=now)
    )
    rows = session.execute(
        select(Job.id, Job.attempt, Job.status, Job.worker_id, Job.cancel_requested).where(Job.id.in_(ids))
    ).all()
    session.commit()
    current = {row.id: row for row in rows}
    lost = set()
    cancel = set()
    for lease in leases:
        row = current.get(lease.job_id)
        if (row is None or row.attempt != lease.attempt or row.status != JobStatus.RUNNING.value
                or row.worker_id != worker_id):
            lost.add(lease.job_id)
        elif row.cancel_requested:
            cancel.add(lease.job_id)
    return LeaseCheck(frozenset(lost), frozenset(cancel))


def write_progress(
    session: Session, *, updates: Iterable[tuple[Lease, dict[str, Any], int]]
) -> None:
    """Coarse progress to SQL for several running jobs in one executemany (fenced by attempt)."""
    params = [
        {"b_id": lease.job_id, "b_attempt": lease.attempt, "b_progress": _sql_safe(progress),
         "b_steps": steps}
        for lease, progress, steps in updates
    ]
    if not params:
        return
    session.execute(
        update(jobs_table)
        .where(
            jobs_table.c.id == bindparam("b_id"),
            jobs_table.c.attempt == bindparam("b_attempt"),
            jobs_table.c.status == JobStatus.RUNNING.value,
        )
        .values(progress=bindparam("b_progress"), steps_used=bindparam("b_steps")),
        params,
    )
    session.commit()
