"""A tenant's "purge it now": one job's data, or every job's of a batch (``DELETE .../data``).

Only a final job's data can go: a queued or running job still needs its input, so the request is
refused (``NotFinishedError``, the API's 409) and the caller cancels first. A batch is purged
only when every one of its jobs is final (all or nothing). Purging again is harmless and answers
the same tombstone. Each purge is done at once (``data_purge.purge_jobs``) and swept once more by
the beat's purge tick ``SETTLE_SECONDS`` later: a request that lands a moment after the job
finished might otherwise come before the worker's last stream events and webhook outbox row.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

import redis
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from scheduler.batches.service import Batch
from scheduler.jobs.models import Job, JobStatus, utcnow
from scheduler.maintenance.data_purge import SETTLE_SECONDS, PurgeResult, purge_jobs

BATCH_CHUNK = 500  # jobs per transaction when a batch is purged


class NotFinishedError(Exception):
    """The job (or some job of the batch) is queued or running: its data is still needed."""

    def __init__(self, active: int) -> None:
        super().__init__(f"{active} job(s) not finished")
        self.active = active


def purge_job_now(session: Session, redis_client: redis.Redis, job: Job, *,
                  now: datetime | None = None, settle: float = SETTLE_SECONDS) -> PurgeResult:
    """Purge ``job``'s data (it must be final, else ``NotFinishedError``); the purge tick sweeps
    it once more ``settle`` seconds later (``data_purge.settle_seconds``)."""
    if not JobStatus(job.status).is_final:
        raise NotFinishedError(1)
    now = now or utcnow()
    return purge_jobs(session, redis_client, [job.id], now=now,
                      sweep_again_at=now + timedelta(seconds=settle))


def purge_batch_now(session: Session, redis_client: redis.Redis, batch: Batch, *,
                    now: datetime | None = None, settle: float = SETTLE_SECONDS) -> int:
    """Purge every job of ``batch`` (all final, else ``NotFinishedError`` and nothing purged), in
    chunks of ``BATCH_CHUNK`` jobs; returns how many were purged."""
    active = session.scalar(
        select(func.count()).select_from(Job)
        .where(Job.batch_id == batch.id, Job.status.in_((JobStatus.QUEUED.value, JobStatus.RUNNING.value)))
    ) or 0
    if active:
        session.commit()
        raise NotFinishedError(int(active))
    now = now or utcnow()
    session.execute(update(Batch).where(Batch.id == batch.id, Batch.purged_at.is_(None))
                    .values(purged_at=now))
    session.commit()
    purged = 0
    after: uuid.UUID | None = None
    while True:
        query = select(Job.id).where(Job.batch_id == batch.id).order_by(Job.id).limit(BATCH_CHUNK)
        if after is not None:
            query = query.where(Job.id > after)
        ids = list(session.scalars(query))
        if not ids:
            return purged
        result = purge_jobs(session, redis_client, ids, now=now,
                            sweep_again_at=now + timedelta(seconds=settle))
        purged += len(result.jobs)
        after = ids[-1]
