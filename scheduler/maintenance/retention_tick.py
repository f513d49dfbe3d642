"""The beat's purge tick (``cloverq.purge_data``): purges the data of jobs whose retention passed.

Retention counts from the job's finish (``finished_at``), which every finish path writes
(worker, reaper, cancel, batch cancel); none of them needs to know about retention. Instead each
tick, every ``beat.purge_interval_seconds``:

1. **schedules** (:func:`schedule_purges`): a finished job with a retention and no purge scheduled
   gets ``purge_at = finished_at + retention_seconds`` (never sooner than
   ``data_purge.SETTLE_SECONDS`` after the finish, so the worker's last stream events and webhook
   row are written before the purge); an **expired** job whose data was never purged
   (``expire_finished_jobs`` drops input and result, but not webhook bodies, error messages or
   OpenAI files) gets ``purge_at = now``. Expiry and retention therefore end the same way: a
   tombstone with ``purged_at``. Index ``ix_jobs_purge_pending`` holds only such jobs.
2. **purges** (:func:`purge_due_jobs`) the jobs whose ``purge_at`` passed, oldest first, through
   ``data_purge.purge_jobs``, which clears ``purge_at`` (index ``ix_jobs_purge_due``).

Both steps take at most ``beat.purge_batch`` jobs per tick (the next tick goes on), and both are
idempotent: a lost or doubled tick changes nothing but timing. ``DELETE .../data`` purges at
once and schedules one more sweep ``SETTLE_SECONDS`` later, which this tick runs.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import cast

import redis
import structlog
from sqlalchemy import Select, Table, bindparam, select, text, update
from sqlalchemy.orm import Session

from scheduler.access.retention import purge_due_at
from scheduler.infra.settings import Settings
from scheduler.jobs.models import PURGE_PENDING_SQL, Job, JobStatus, utcnow
from scheduler.maintenance.data_purge import SETTLE_SECONDS, purge_jobs, settle_seconds

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class TickResult:
    scheduled: int
    purged: int


def pending_query(limit: int) -> Select[uuid.UUID, str, datetime | None, int | None]:
    """Finished jobs that will need a purge and have none scheduled (``ix_jobs_purge_pending``:
    its predicate, verbatim, so PostgreSQL can use the partial index)."""
    return (select(Job.id, Job.status, Job.finished_at, Job.retention_seconds)
            .where(text(PURGE_PENDING_SQL), Job.finished_at.is_not(None))
            .order_by(Job.finished_at).limit(limit))


def due_query(now: datetime, limit: int) -> Select[uuid.UUID]:
    """Jobs whose purge is due, oldest first (``ix_jobs_purge_due``)."""
    return select(Job.id).where(Job.purge_at <= now).order_by(Job.purge_at).limit(limit)


def schedule_purges(session: Session, *, now: datetime, limit: int, settle: float = SETTLE_SECONDS) -> int:
    """Step 1: give up to ``limit`` finished jobs that need a purge their ``purge_at``."""
    rows = session.execute(pending_query(limit)).all()
    due = [{"b_id": row.id, "b_due": _due(row.status, row.finished_at, row.retention_seconds, now, settle)}
           for row in rows]
    if due:
        table = cast(Table, Job.__table__)
        session.connection().execute(
            update(table).where(table.c.id == bindparam("b_id"), table.c.purge_at.is_(None))
            .values(purge_at=bindparam("b_due", type_=table.c.purge_at.type)),
            due,
        )
    session.commit()
    return len(due)


def _due(status: str, finished_at: datetime, retention_seconds: int | None, now: datetime,
         settle: float = SETTLE_SECONDS) -> datetime:
    if status == JobStatus.EXPIRED.value or retention_seconds is None:
        return now  # expired: past the result TTL already, only its leftovers remain
    return purge_due_at(finished_at, retention_seconds, settle_seconds=settle)


def purge_due_jobs(session: Session, *, redis_client: redis.Redis, now: datetime, limit: int) -> int:
    """Step 2: purge up to ``limit`` jobs whose ``purge_at`` passed; returns how many."""
    ids = list(session.scalars(due_query(now, limit)))
    session.commit()
    if not ids:
        return 0
    result = purge_jobs(session, redis_client, ids, now=now)
    if ids and len(result.jobs) < len(ids):  # scheduled but not final (cannot happen): unschedule
        stray = set(ids) - set(result.jobs)
        session.execute(update(Job).where(Job.id.in_(stray)).values(purge_at=None))
        session.commit()
    log.info("retention.purged", jobs=len(result.jobs), deliveries=result.deliveries,
             openai_batches=result.openai_batches, redis_ok=result.redis_ok)
    return len(result.jobs)


def run_tick(session: Session, *, redis_client: redis.Redis, settings: Settings,
             now: datetime | None = None) -> TickResult:
    """One purge tick: schedule, then purge (see the module docstring)."""
    now = now or utcnow()
    limit = settings.beat.purge_batch
    scheduled = schedule_purges(session, now=now, limit=limit, settle=settle_seconds(settings))
    purged = purge_due_jobs(session, redis_client=redis_client, now=now, limit=limit)
    return TickResult(scheduled=scheduled, purged=purged)
