"""Where the publishing paths meet fair share: publish now, or hold and release by DRR.

Every path that gives a queued job its first message goes through here, so one setting
(``scheduling.fair_share``) decides for all of them:

- a submitted job (``scheduler/jobs/service.py`` ``submit_job``): :func:`publish_submitted`. While
  its class holds nothing and its list is below the window, it is published at once exactly as
  without fair share (one extra Redis script); otherwise it is held and a release pass runs;
- a batch (``scheduler/batches/service.py`` ``publish_batch``): :func:`hold_batch`, every job held,
  then a pass (which publishes at once whatever the window has room for);
- the reconciler and the delayed tick (queued rows without a message): :func:`hold_recovered`
  (held unless a marker says a message exists; a held marker whose entry is gone is healed).

Aging (``promote_aged_jobs``) is the one path that publishes past fair share, by design: it is
the bound against starvation *between* classes, and it takes jobs round robin across tenants.
With fair share off everything publishes directly, as before, and a held marker left from when it
was on counts as no message (the reconciler publishes the job; the beat tick drops the index).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import redis
import structlog
from celery import Celery
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from scheduler.fairness.drr import flow_id
from scheduler.fairness.held import HeldJob, forget, forget_flow, stage, stage_or_pass, submission_order
from scheduler.fairness.release import Releaser, Sessions
from scheduler.infra import redis_keys
from scheduler.infra.db import get_session_factory
from scheduler.infra.queue_names import JOB_QUEUES
from scheduler.infra.settings import Settings
from scheduler.jobs.enqueue import try_publish_job
from scheduler.jobs.models import Job

log = structlog.get_logger(__name__)

SUBMIT_PASSES = 1  # a request thread serves one pass at most; kicks and ticks do the rest
BATCH_PASSES = 2
READ_CHUNK = 1000  # ids per SQL read of a batch's jobs


def enabled(settings: Settings) -> bool:
    return settings.scheduling.fair_share


def releaser(settings: Settings, app: Celery, redis_client: redis.Redis,
             sessions: Sessions | None = None) -> Releaser:
    """A releaser over ``sessions`` (default: the process's session factory for the settings' database)."""
    factory = sessions or get_session_factory(settings.resolved_database_url)
    return Releaser(settings=settings, sessions=factory, redis=redis_client, app=app)


def sessions_like(session: Session) -> Sessions:
    """New sessions on ``session``'s engine (a release pass inside a request uses the app's pool)."""
    bind = session.get_bind()
    return lambda: Session(bind=bind, expire_on_commit=False)


def release_quietly(releaser: Releaser, queue: str, *, max_passes: int) -> int:
    """:meth:`Releaser.release`, a failure logged: the next kick or beat tick releases instead."""
    try:
        return releaser.release(queue, max_passes=max_passes)
    except (redis.RedisError, SQLAlchemyError) as exc:
        log.warning("fair_share.release_failed", queue=queue, error=f"{type(exc).__name__}: {exc}")
        return 0


def held_job(job: Job | Any, *, seq: int | None = None) -> HeldJob:
    """``job`` (a ``Job``, or a SQL row with its id, queue, tenant, batch_id, cost, created_at) as
    the held index stores it."""
    return HeldJob(job_id=job.id, queue=job.queue, tenant=job.tenant, batch_id=job.batch_id, cost=job.cost,
                   order=submission_order(job.created_at, seq))


def publish_submitted(
    job: Job, *, settings: Settings, app: Celery, redis_client: redis.Redis, request_id: str | None,
    marker_set: bool, job_lane: str, sessions: Sessions | None = None,
) -> None:
    """Publish a just-committed job, or hold it (see the module docstring). A broker failure is
    logged and left to the reconciler, like ``try_publish_job``'s. ``sessions``: for a release
    pass (default: the process's factory for the settings' database)."""
    def publish() -> None:
        try_publish_job(job_id=job.id, queue=job.queue, app=app, redis_client=redis_client,
                        request_id=request_id, marker_set=marker_set, tenant=job.tenant, lane=job_lane)

    if not enabled(settings):
        publish()
        return
    try:
        held = stage_or_pass(redis_client, held_job(job), window=settings.scheduling.fair_share_window,
                             queue_lane=job.queue)
    except redis.RedisError as exc:  # the row is durable: the reconciler holds or publishes it
        log.warning("job.publish_failed", job_id=str(job.id), queue=job.queue, error=repr(exc))
        _drop_admission_marker(redis_client, job)
        return
    if not held:
        publish()
        return
    release_quietly(releaser(settings, app, redis_client, sessions), job.queue, max_passes=SUBMIT_PASSES)


# Deletes the job's enqueued marker only while it still holds what admission wrote (the queue name):
# a ``held:`` marker means the hold did happen, a lane means a release already published it.
_DROP_IF_QUEUE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _drop_admission_marker(client: redis.Redis, job: Job) -> None:
    """After a failed hold, the marker admission set names a message that does not exist; left in
    place it would hide the job from the reconciler until the class's list drains or the marker
    expires. Best effort: Redis just failed, and the marker's TTL is the backstop."""
    try:
        client.eval(_DROP_IF_QUEUE_LUA, 1, redis_keys.enqueued(job.id), job.queue)
    except redis.RedisError as exc:
        log.warning("job.marker_drop_failed", job_id=str(job.id), error=type(exc).__name__)


def hold_batch(jobs: Sequence[HeldJob], *, settings: Settings, app: Celery, redis_client: redis.Redis,
               sessions: Sessions | None = None) -> int:
    """Hold every job of a just-committed batch (dropping their admission reservations), then
    release what the windows have room for. Returns how many were held."""
    held = 0
    for queue in sorted({job.queue for job in jobs}):
        held += sum(stage(redis_client, [job for job in jobs if job.queue == queue]))
        release_quietly(releaser(settings, app, redis_client, sessions), queue, max_passes=BATCH_PASSES)
    return held


def hold_committed_batch(
    jobs: Sequence[tuple[uuid.UUID, str]], *, settings: Settings, sessions: Sessions, app: Celery,
    redis_client: redis.Redis,
) -> int:
    """:func:`hold_batch` for ``publish_batch``'s ``(job_id, queue)`` list (submission order: each
    job's index is its order in its flow); tenant, batch and cost are read back from SQL."""
    rows: dict[uuid.UUID, Any] = {}
    ids = [job_id for job_id, _ in jobs]
    with sessions() as session:
        for start in range(0, len(ids), READ_CHUNK):
            rows.update((row.id, row) for row in session.execute(
                select(Job.id, Job.queue, Job.tenant, Job.batch_id, Job.cost)
                .where(Job.id.in_(ids[start:start + READ_CHUNK]))))
        session.commit()
    held = [HeldJob(job_id=row.id, queue=row.queue, tenant=row.tenant, batch_id=row.batch_id, cost=row.cost,
                    order=float(seq))
            for seq, job_id in enumerate(ids) if (row := rows.get(job_id)) is not None]
    return hold_batch(held, settings=settings, app=app, redis_client=redis_client, sessions=sessions)


def hold_recovered(
    jobs: Sequence[HeldJob], *, settings: Settings, app: Celery, redis_client: redis.Redis,
    max_passes: int = 4,
) -> int:
    """Hold queued rows that have no message (a lost one, a retry come due, a delayed job come
    due), unless a marker says a message exists; then release. Returns how many were held."""
    held = 0
    for queue in sorted({job.queue for job in jobs}):
        held += sum(stage(redis_client, [job for job in jobs if job.queue == queue], if_unmarked=True))
        release_quietly(releaser(settings, app, redis_client), queue, max_passes=max_passes)
    if held:
        log.info("fair_share.held_recovered", jobs=held)
    return held


def forget_cancelled(client: redis.Redis, job: Job) -> None:
    """A job cancelled while queued leaves the held index (before ``mark_dead``, which then finds no
    marker: a held job has no message). Not held: nothing happens. A Redis failure is logged: the
    release pass drops a stale entry itself (its SQL check)."""
    try:
        forget(client, [held_job(job)])
    except redis.RedisError as exc:
        log.warning("fair_share.forget_failed", job_id=str(job.id), error=type(exc).__name__)


def forget_cancelled_batch(client: redis.Redis, *, tenant: str, batch_id: uuid.UUID) -> None:
    """Every held job of a cancelled batch leaves the index (its flow, in every class)."""
    flow = flow_id(tenant, batch_id)
    try:
        for queue in JOB_QUEUES:
            forget_flow(client, queue, flow, [])
    except redis.RedisError as exc:
        log.warning("fair_share.forget_failed", batch_id=str(batch_id), error=type(exc).__name__)
