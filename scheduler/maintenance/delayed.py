"""The delayed-job tick: publish delayed jobs (``scheduler/jobs/schedule.py``) as they come due.

The reconciler would publish a due delayed job too (it is a queued row without a message), but
only after ``beat.reconcile_grace_seconds`` and on its ``reconcile_interval_seconds`` tick: up to
~7 s late by default, where a delayed job promises to start within 2 s of its time. This tick
runs every ``beat.delayed_interval_seconds`` (1 s) and reads only delayed rows that came due since
it last looked: a range scan of the index ``ix_jobs_status_scheduled`` (``status = 'queued'``,
``scheduled_for`` in (cursor, now]). Ordinary queued jobs (``scheduled_for`` NULL) are never
read, however deep the backlog.

The cursor, ``(scheduled_for, id)`` of the last row handled, lives in Redis
(``redis_keys.DELAYED_CURSOR``), so each due delayed job is read once even when thousands come due
together (keyset pages of ``BATCH``), and a restarted beat goes on where the last one stopped: a job
that came due while beat was down is published by the first tick after the restart. Without a
cursor (first run, Redis flushed) the tick starts ``LOOKBACK`` back; anything older is the
reconciler's, as before. A row committed after the cursor passed its time (its submitter's clock
behind the beat's) is likewise the reconciler's; the submitter publishes a job itself when it is
already due at its commit (``scheduler/jobs/service.py`` ``submit_job``).

A row that holds an enqueued marker (a message exists, or fair share holds it) is skipped;
publishing twice would still be harmless (the fenced claim). With fair share on
(``scheduling.fair_share``) a due job is not published directly but held like a recovered one
(``scheduler/fairness/gate.py`` ``hold_recovered``): the release pass that follows publishes it
at once while its class's window has room, else in its tenant's DRR turn. A failed publish ends
the tick there, the cursor stays before the row and the next tick retries it.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import redis
import structlog
from celery import Celery, shared_task
from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from scheduler.fairness import gate as fair_share
from scheduler.fairness.held import HeldJob
from scheduler.infra import redis_keys
from scheduler.infra.celery_app import get_celery_app
from scheduler.infra.db import get_session_factory
from scheduler.infra.periodic_tick import TICK_TASK_OPTIONS
from scheduler.infra.redis_client import get_redis
from scheduler.infra.settings import Settings, get_settings
from scheduler.jobs.enqueue import try_publish_job
from scheduler.jobs.models import Job, JobStatus, as_utc, utcnow
from scheduler.model_versions.canary import current_route
from scheduler.model_versions.canary_routing import lane

log = structlog.get_logger(__name__)

RELEASE_DELAYED_TASK = "cloverq.release_delayed"
BATCH = 1000  # rows per tick; the next tick goes on from the cursor
LOOKBACK = timedelta(minutes=5)  # where a tick without a cursor starts


def read_cursor(client: redis.Redis) -> tuple[datetime, uuid.UUID] | None:
    raw = client.get(redis_keys.DELAYED_CURSOR)
    if not raw:
        return None
    try:
        due, job_id = (raw.decode() if isinstance(raw, bytes) else str(raw)).split("|", 1)
        return as_utc(datetime.fromisoformat(due)), uuid.UUID(job_id)
    except ValueError:  # not ours: start over from the lookback
        return None


def write_cursor(client: redis.Redis, due: datetime, job_id: uuid.UUID) -> None:
    client.set(redis_keys.DELAYED_CURSOR, f"{due.isoformat()}|{job_id}")


def release_due_delayed(
    session: Session, *, app: Celery, redis_client: redis.Redis, settings: Settings,
    now: datetime | None = None,
) -> int:
    """Publish (or, with fair share, hold) the delayed jobs that came due since the cursor (see the
    module docstring). Returns how many were published or held."""
    now = now or utcnow()
    cursor = read_cursor(redis_client)
    after = (Job.scheduled_for > now - LOOKBACK if cursor is None else
             or_(Job.scheduled_for > cursor[0], and_(Job.scheduled_for == cursor[0], Job.id > cursor[1])))
    rows = session.execute(
        select(Job.id, Job.queue, Job.request_id, Job.routed_version, Job.trace_id, Job.trace_span_id,
               Job.scheduled_for, Job.tenant, Job.batch_id, Job.cost, Job.created_at)
        .where(Job.status == JobStatus.QUEUED.value, Job.scheduled_for <= now, after,
               Job.available_at <= now, Job.cancel_requested.is_(False))
        .order_by(Job.scheduled_for, Job.id)
        .limit(BATCH)
    ).all()
    canary = current_route(session, settings.model.served) if rows else None
    session.commit()
    if not rows:
        return 0
    with redis_client.pipeline(transaction=False) as pipe:
        for row in rows:
            pipe.exists(redis_keys.enqueued(row.id))
        marked = pipe.execute()
    published = 0
    last: Any = None
    recovered: list[HeldJob] = []
    fair = fair_share.enabled(settings)
    for row, has_message in zip(rows, marked, strict=True):
        if not has_message and fair:  # held, and released by DRR as its class's window has room
            recovered.append(fair_share.held_job(row))
        elif not has_message:
            target = lane(row.queue, row.routed_version, canary)
            if not try_publish_job(job_id=row.id, queue=row.queue, app=app, redis_client=redis_client,
                                   request_id=row.request_id, lane=target,
                                   trace_ids=(row.trace_id, row.trace_span_id)):
                break  # broker trouble: retried from here next tick
            published += 1
        last = row
    if recovered:
        published += fair_share.hold_recovered(recovered, settings=settings, app=app,
                                               redis_client=redis_client)
    if last is not None:
        write_cursor(redis_client, last.scheduled_for, last.id)
    if published:
        log.info("delayed.released", jobs=published)
    return published


@shared_task(name=RELEASE_DELAYED_TASK, **TICK_TASK_OPTIONS)  # a tick: see maintenance
def release_delayed_task() -> int:
    settings = get_settings()
    with get_session_factory(settings.resolved_database_url)() as session:
        return release_due_delayed(session, app=get_celery_app(), settings=settings,
                                   redis_client=get_redis(settings.resolved_redis_url))
