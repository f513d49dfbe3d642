"""Recovery and housekeeping run by beat: reconciler, reaper, aging, expiry.

The reconcile tick also restores the operator state (drain flags, limits) to Redis from SQL
(``scheduler.fleet.operator_state``), so a Redis restart never resumes a drained queue or drops a cap.

Plain functions over a session (testable without a broker) plus thin Celery tasks that call
them with the process-wide resources. All of them are idempotent and safe to run concurrently
with workers: every transition is a conditional UPDATE.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

import redis
import structlog
from celery import Celery, shared_task
from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from scheduler.fairness import gate as fair_share
from scheduler.fairness.aging import fair_aging_candidates, forget_promoted
from scheduler.fairness.held import HeldJob, is_held_marker
from scheduler.fairness.weights import read_weights
from scheduler.fleet.operator_state import restore_quietly
from scheduler.infra import redis_keys, tick_claims
from scheduler.infra.celery_app import get_celery_app
from scheduler.infra.db import get_session_factory, rowcount
from scheduler.infra.periodic_tick import TICK_TASK_OPTIONS
from scheduler.infra.redis_client import get_redis
from scheduler.infra.settings import Settings, get_settings
from scheduler.jobs.dead_messages import job_id_of_message, purge_dead_messages
from scheduler.jobs.enqueue import try_publish_job
from scheduler.jobs.models import FINAL_STATUSES, ErrorCode, Job, JobStatus, QueueName, as_utc, utcnow
from scheduler.jobs.retry import backoff_seconds
from scheduler.maintenance import retention_tick
from scheduler.model_versions.canary import current_route
from scheduler.model_versions.canary_reconcile import heal_pins
from scheduler.model_versions.canary_routing import is_canary_lane, lane
from scheduler.observability.metrics_recorder import RedisMetricsRecorder

log = structlog.get_logger(__name__)

BATCH = 1000  # rows handled per tick; the reconciler's next tick continues after them (a cursor)
EXPIRY_BATCH = 1000  # rows one expiry statement takes at most (settings.beat.expiry_batch)

# Kombu's Redis transport keeps a delivered, unacknowledged message here until it is acked or
# the visibility timeout restores it (kombu's default key names; cloverq does not change them).
KOMBU_UNACKED = "unacked"
KOMBU_UNACKED_INDEX = "unacked_index"


def _job_id_of_delivery(raw: str | bytes | None) -> uuid.UUID | None:
    """The job id of a ``cloverq.run_job`` message as kombu stores it unacked ([message, exchange,
    routing key]); None otherwise."""
    if raw is None:
        return None
    try:
        return job_id_of_message(json.loads(raw)[0])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def release_orphaned_deliveries(
    session: Session, *, redis_client: redis.Redis, settings: Settings, now: datetime | None = None
) -> int:
    """Queued jobs whose message was delivered to a worker that died before claiming it.

    Such a message waits in kombu's unacked set until the visibility timeout (longer than the
    longest deadline: hours) and the job's enqueued marker stays, so the reconciler would not
    publish it again: the job would sit in ``queued``. A live worker claims a delivery within
    milliseconds, so a ``run_job`` delivery older than a lease whose job is still queued is
    orphaned: it is dropped from the unacked set and the marker released, and
    ``enqueue_due_jobs`` publishes the job again (a late duplicate is fenced off by the claim).
    Returns how many jobs were released.
    """
    cutoff = (now or utcnow()).timestamp() - settings.jobs.lease_seconds
    tags = cast("list[bytes]",
                redis_client.zrangebyscore(KOMBU_UNACKED_INDEX, "-inf", cutoff, start=0, num=BATCH))
    if not tags:
        return 0
    by_job: dict[uuid.UUID, list[Any]] = {}
    for tag, raw in zip(tags, redis_client.hmget(KOMBU_UNACKED, tags), strict=True):
        job_id = _job_id_of_delivery(raw)
        if job_id is not None:
            by_job.setdefault(job_id, []).append(tag)
    if not by_job:
        return 0
    queued = list(session.scalars(
        select(Job.id).where(Job.id.in_(list(by_job)), Job.status == JobStatus.QUEUED.value)
    ))
    session.commit()
    if not queued:
        return 0
    pipe = redis_client.pipeline(transaction=True)
    for job_id in queued:
        for tag in by_job[job_id]:
            pipe.zrem(KOMBU_UNACKED_INDEX, tag)
            pipe.hdel(KOMBU_UNACKED, tag)
        pipe.delete(redis_keys.enqueued(job_id))
    pipe.execute()
    log.warning("reconciler.orphaned_deliveries_released", jobs=len(queued))
    return len(queued)


def release_lost_messages(
    session: Session, *, redis_client: redis.Redis, settings: Settings, now: datetime | None = None
) -> int:
    """Queued jobs whose marker says a message exists, but the message is nowhere.

    Kombu's Redis transport takes a message with BRPOP and only then, client-side, records it
    as unacked: a worker killed in between (a poison job's SIGKILL hits every thread of the
    process) loses the message outright, while the job's enqueued marker stays and keeps the
    reconciler away for the marker's TTL (a day). Proof of loss, cheaply: the job has been
    due for more than a lease, its marker is older than a lease, its queue is EMPTY (so the
    message is not waiting in it) and no delivery of it is held unacked. Such markers are
    released, so ``enqueue_due_jobs`` publishes the job again. Returns how many.
    """
    now = now or utcnow()
    rows = session.execute(
        select(Job.id, Job.queue, Job.routed_version)
        .where(Job.status == JobStatus.QUEUED.value, Job.cancel_requested.is_(False),
               Job.available_at <= now - timedelta(seconds=settings.jobs.lease_seconds))
        .order_by(Job.available_at)
        .limit(BATCH)
    ).all()
    canary = current_route(session, settings.model.served) if rows else None
    session.commit()
    if not rows:
        return 0
    lanes = [lane(row.queue, row.routed_version, canary) for row in rows]  # where each message waits
    queues = sorted(set(lanes))
    pipe = redis_client.pipeline(transaction=False)
    for queue in queues:
        pipe.llen(queue)
    for row in rows:
        pipe.ttl(redis_keys.enqueued(row.id))
    for row in rows:  # a held job's marker (scheduler/fairness/held.py) stands for no message
        pipe.get(redis_keys.enqueued(row.id))
    answers = pipe.execute()
    empty = {queue for queue, length in zip(queues, answers[:len(queues)], strict=True) if length == 0}
    oldest_fresh_ttl = redis_keys.ENQUEUED_TTL_SECONDS - settings.jobs.lease_seconds
    ttls, values = answers[len(queues):len(queues) + len(rows)], answers[len(queues) + len(rows):]
    suspects = [row.id for row, row_lane, ttl, value in zip(rows, lanes, ttls, values, strict=True)
                if row_lane in empty and 0 < ttl < oldest_fresh_ttl and not is_held_marker(value)]
    if not suspects:
        return 0
    held = {_job_id_of_delivery(raw) for raw in redis_client.hvals(KOMBU_UNACKED)}
    lost = [job_id for job_id in suspects if job_id not in held]
    if lost:
        redis_client.delete(*(redis_keys.enqueued(job_id) for job_id in lost))
        log.warning("reconciler.lost_messages_released", jobs=len(lost))
    return len(lost)


def enqueue_due_jobs(
    session: Session, *, app: Celery, redis_client: redis.Redis, settings: Settings,
    now: datetime | None = None,
) -> int:
    """Reconciler: publish every due queued job that has no message in Redis, or whose message
    waits on a canary lane it no longer belongs to (the marker records the lane, see
    ``scheduler.model_versions.canary_reconcile``). Returns how many."""
    now = now or utcnow()
    due_before = now - timedelta(seconds=settings.beat.reconcile_grace_seconds)
    query = (
        select(Job.id, Job.queue, Job.request_id, Job.routed_version, Job.trace_id, Job.trace_span_id,
               Job.tenant, Job.batch_id, Job.cost, Job.created_at, Job.available_at)
        .where(Job.status == JobStatus.QUEUED.value, Job.available_at <= due_before,
               Job.cancel_requested.is_(False))
    )
    after = _reconcile_cursor(redis_client)
    if after is not None:
        at, job_id = after
        query = query.where(or_(Job.available_at > at, and_(Job.available_at == at, Job.id > job_id)))
    rows = session.execute(query.order_by(Job.available_at, Job.id).limit(BATCH)).all()
    _set_reconcile_cursor(redis_client, rows[-1] if len(rows) == BATCH else None)
    canary = current_route(session, settings.model.served) if rows else None
    session.commit()
    if not rows:
        return 0
    pipe = redis_client.pipeline(transaction=False)
    for row in rows:
        pipe.get(redis_keys.enqueued(row.id))
    markers = pipe.execute()
    published = 0
    fair = fair_share.enabled(settings)
    recovered: list[HeldJob] = []  # held (again) rather than published: scheduler/fairness/gate.py
    for row, marker in zip(rows, markers, strict=True):
        expected = lane(row.queue, row.routed_version, canary)
        held = marker.decode() if isinstance(marker, bytes) else marker
        if is_held_marker(held):  # held by fair share: healed if its index entry is gone
            if fair:
                recovered.append(fair_share.held_job(row))
                continue
            held = None  # fair share switched off: a held job has no message
        if held is not None and not (is_canary_lane(held) and held != expected):
            continue
        if fair and held is None:
            recovered.append(fair_share.held_job(row))
            continue
        if try_publish_job(job_id=row.id, queue=row.queue, app=app, redis_client=redis_client,
                           request_id=row.request_id, lane=expected,
                           trace_ids=(row.trace_id, row.trace_span_id)):
            published += 1
    if recovered:
        published += fair_share.hold_recovered(recovered, settings=settings, app=app,
                                               redis_client=redis_client)
    if published:
        log.info("reconciler.republished", jobs=published)
    return published


def _reconcile_cursor(client: redis.Redis) -> tuple[datetime, uuid.UUID] | None:
    """Where the last full page of :func:`enqueue_due_jobs` ended. Why pages: held fair-share jobs
    stay queued rows without a message, so the oldest ``BATCH`` rows may all be held ones, and a
    scan that always read the oldest would never reach a newer row whose message was lost. Each
    tick reads the next page; a short page starts the next tick over. None: from the start."""
    try:
        raw = client.get(redis_keys.RECONCILE_CURSOR)
        if raw is None:
            return None
        at, job_id = (raw.decode() if isinstance(raw, bytes) else str(raw)).split("|", 1)
        return as_utc(datetime.fromisoformat(at)), uuid.UUID(job_id)
    except (redis.RedisError, ValueError):
        return None


def _set_reconcile_cursor(client: redis.Redis, last: Any | None) -> None:
    try:
        if last is None:
            client.delete(redis_keys.RECONCILE_CURSOR)
        else:
            client.set(redis_keys.RECONCILE_CURSOR, f"{as_utc(last.available_at).isoformat()}|{last.id}",
                       ex=redis_keys.ENQUEUED_TTL_SECONDS)
    except redis.RedisError as exc:  # the next tick starts over: slower, never wrong
        log.warning("reconciler.cursor_failed", error=type(exc).__name__)


@dataclass(frozen=True)
class ReapResult:
    requeued: int
    failed: int
    cancelled: int


def reap_expired_leases(
    session: Session, *, redis_client: redis.Redis, settings: Settings, now: datetime | None = None
) -> ReapResult:
    """Reaper: a running job whose lease expired (worker died) is requeued, failed or cancelled."""
    now = now or utcnow()
    rows = session.execute(
        select(Job.id, Job.attempt, Job.max_attempts, Job.cancel_requested, Job.kind, Job.queue,
               Job.created_at, Job.started_at, Job.worker_id)
        .where(Job.status == JobStatus.RUNNING.value, Job.lease_deadline < now)
        .order_by(Job.worker_id, Job.id)
        .limit(BATCH)
    ).all()
    # Jobs that died together (one worker) come back one reconcile tick apart. Republished in
    # the same tick they would land on one worker together again, so a poison job that kills
    # its process would take the same neighbours down on every attempt and exhaust theirs too.
    lost_together: dict[str | None, int] = {}
    requeued = failed = cancelled = 0
    reaped: list[tuple[Any, str]] = []  # (row, new status) for the metrics below
    expires = now + timedelta(seconds=settings.jobs.result_ttl_seconds)
    for row in rows:
        fence = (Job.id == row.id, Job.attempt == row.attempt, Job.status == JobStatus.RUNNING.value,
                 Job.lease_deadline < now)
        if row.cancel_requested:
            values = {"status": JobStatus.CANCELLED.value, "finished_at": now, "expires_at": expires}
        elif row.attempt >= row.max_attempts:
            values = {"status": JobStatus.FAILED.value, "finished_at": now, "expires_at": expires,
                      "error_code": ErrorCode.RETRIES_EXHAUSTED.value,
                      "error_message": f"lease expired on attempt {row.attempt} (worker lost)"}
        else:
            rank = lost_together[row.worker_id] = lost_together.get(row.worker_id, -1) + 1
            delay = backoff_seconds(row.attempt, settings) + rank * settings.beat.reconcile_interval_seconds
            values = {"status": JobStatus.QUEUED.value, "available_at": now + timedelta(seconds=delay),
                      "worker_id": None,
                      "error_message": f"attempt {row.attempt}: lease expired (worker lost)"}
        written = rowcount(session.execute(
            update(Job).where(*fence).values(lease_deadline=None, updated_at=now, **values)
        ))
        if not written:
            continue
        reaped.append((row, str(values["status"])))
        if values["status"] == JobStatus.QUEUED.value:
            requeued += 1
        elif values["status"] == JobStatus.FAILED.value:
            failed += 1
        else:
            cancelled += 1
    session.commit()
    if requeued:  # their old message is gone with the dead worker's reservation: allow a republish
        redis_client.delete(*(redis_keys.enqueued(row.id) for row in rows))
    if rows:
        log.info("reaper.reaped", requeued=requeued, failed=failed, cancelled=cancelled)
    _record_reaped(redis_client, reaped, now=now)
    return ReapResult(requeued=requeued, failed=failed, cancelled=cancelled)


def _record_reaped(redis_client: redis.Redis, reaped: list[tuple[Any, str]], *, now: datetime) -> None:
    """Metrics of reaped attempts (a lost worker): retries, dead letters, finished jobs."""
    recorder = RedisMetricsRecorder(redis_client)
    for row, status in reaped:  # a handful of rows, only when workers died
        if status == JobStatus.QUEUED.value:
            recorder.safe(recorder.job_retried, kind=row.kind, queue=row.queue, reason="worker_lost")
            continue
        if status == JobStatus.FAILED.value:
            recorder.safe(recorder.dead_letter, kind=row.kind, queue=row.queue)
        wait = (row.started_at - row.created_at).total_seconds() if row.started_at else None
        run = (now - row.started_at).total_seconds() if row.started_at else None
        recorder.safe(recorder.job_finished, kind=row.kind, queue=row.queue, status=status,
                      wait_seconds=wait, run_seconds=run, steps_used=None, tokens=None)


AGING_SOURCES: tuple[str, ...] = (QueueName.STANDARD.value, QueueName.BULK.value)


def promote_aged_jobs(
    session: Session, *, app: Celery, redis_client: redis.Redis, settings: Settings,
    now: datetime | None = None,
) -> int:
    """Aging: the oldest jobs queued longer than ``aging_seconds`` move to ``interactive``.

    At most ``aging_max_promoted`` promoted jobs wait in ``interactive`` at any time, so a big
    aged backlog gets a steady, oldest-first share of the workers (no starvation) without ever
    putting more than that many long jobs ahead of a new short one. The new message goes to the
    back of ``interactive``; the old one, when consumed, finds the job already claimed (or
    claims it first — either way one outcome).
    """
    now = now or utcnow()
    waiting_promoted = session.scalar(
        select(func.count()).select_from(Job).where(
            Job.status == JobStatus.QUEUED.value, Job.queue == QueueName.INTERACTIVE.value,
            Job.priority.in_(AGING_SOURCES))
    ) or 0
    room = min(BATCH, settings.scheduling.aging_max_promoted - waiting_promoted)
    if room <= 0:
        session.commit()
        return 0
    cutoff = now - timedelta(seconds=settings.scheduling.aging_seconds)
    fair = fair_share.enabled(settings)  # then each tenant's oldest in turn (scheduler/fairness/aging.py)
    candidates = fair_aging_candidates(session, sources=AGING_SOURCES, cutoff=cutoff, room=room,
                                       weights=read_weights(redis_client)) if fair else []
    oldest = [row.id for row in candidates] if fair else [row.id for row in session.execute(
        select(Job.id)
        .where(Job.status == JobStatus.QUEUED.value, Job.queue.in_(AGING_SOURCES),
               Job.available_at <= cutoff, Job.cancel_requested.is_(False))
        .order_by(Job.available_at, Job.id)
        .limit(room)
    )]
    if not oldest:
        session.commit()
        return 0
    moved = session.execute(
        update(Job)
        .where(Job.id.in_(oldest), Job.status == JobStatus.QUEUED.value, Job.queue.in_(AGING_SOURCES))
        .values(queue=QueueName.INTERACTIVE.value, updated_at=now)
        .returning(Job.id, Job.request_id, Job.routed_version, Job.trace_id, Job.trace_span_id)
    ).all()
    canary = current_route(session, settings.model.served)
    session.commit()
    if fair:  # out of their old class's held index before their new message exists
        moved_ids = {row.id for row in moved}
        forget_promoted(redis_client, [row for row in candidates if row.id in moved_ids])
    promoted = sum(
        try_publish_job(job_id=row.id, queue=QueueName.INTERACTIVE.value, app=app,
                        redis_client=redis_client, request_id=row.request_id,
                        lane=lane(QueueName.INTERACTIVE.value, row.routed_version, canary),
                        trace_ids=(row.trace_id, row.trace_span_id))
        for row in moved
    )
    if promoted:
        log.info("aging.promoted", jobs=promoted)
    return promoted


def expire_finished_jobs(
    session: Session, *, now: datetime | None = None, batch_size: int = EXPIRY_BATCH
) -> int:
    """Expiry: finished jobs past their result TTL become ``expired``; payloads are dropped.

    In batches of at most ``batch_size`` rows (``CLOVERQ_EXPIRY_BATCH``), each its own short
    transaction under the ordinary statement timeout, until a batch finds fewer than it may take.
    Why not one UPDATE over every due row (issue 32): on a backlog (results piled up while the beat
    was down, a lowered TTL) that one statement either runs into the 30 s statement timeout and
    rolls back the same way on every tick, so nothing ever expires, or, with the timeout lifted
    for it (as it was), runs unbounded while it holds the row locks of the whole backlog. A batch
    that commits is kept whatever happens to the next one.
    ``SKIP LOCKED`` (PostgreSQL): rows another transaction holds (a second beat's expiry, the purge
    tick) are left to the next tick instead of waited for. Returns how many jobs expired."""
    now = now or utcnow()
    finished = [s.value for s in FINAL_STATUSES if s is not JobStatus.EXPIRED]
    due = and_(Job.status.in_(finished), Job.expires_at < now)
    batch = select(Job.id).where(due).limit(batch_size)
    if session.get_bind().dialect.name == "postgresql":
        # A locking CTE, not ``IN (LIMIT subquery)``: PostgreSQL may evaluate that subquery again
        # on a rescan (seen: one "batch" of 20 updated 50 rows); a CTE with FOR UPDATE runs once.
        chosen = batch.with_for_update(skip_locked=True).cte("expiring")
        batch = select(chosen.c.id)
    # SQLite: a plain uncorrelated subquery, run once (pysqlite counts no rows for WITH ... UPDATE).
    expire = (update(Job).where(Job.id.in_(batch), due)
              .values(status=JobStatus.EXPIRED.value, input=None, result=None, progress=None, updated_at=now)
              .execution_options(synchronize_session=False))
    expired = 0
    while True:
        done = rowcount(session.execute(expire))
        session.commit()
        expired += done
        if done < batch_size:
            return expired


# --- Celery tasks (run by the light beat worker on the ``maintenance`` queue) -------------------
#
# Acked on receipt, not late: every tick is idempotent and the next one replaces a lost one, so
# redelivery buys nothing. And an unacked delivery is what kills the beat process when Redis
# restarts: closing the broken channel "restores" it, and kombu's Redis transport then raises
# AttributeError ('NoneType' object has no attribute 'hostname', conninfo already gone), which
# Celery treats as unrecoverable, so the one process running reconciler and reaper exits.
# Each tick message runs at most once (scheduler/infra/periodic_tick.py: a handed-back delivery).
MAINTENANCE_TASK_OPTIONS: dict[str, Any] = dict(TICK_TASK_OPTIONS)


def _resources() -> tuple[Session, redis.Redis, Settings]:
    settings = get_settings()
    session = get_session_factory(settings.resolved_database_url)()
    return session, get_redis(settings.resolved_redis_url), settings


@shared_task(name="cloverq.reconcile", **MAINTENANCE_TASK_OPTIONS)
def reconcile_task() -> int:
    session, client, settings = _resources()
    with session:
        # First: a Redis that came back empty gets its drain flags and limits before any job is
        # republished (cheap and idempotent when Redis already matches SQL).
        restore_quietly(session, client, where="reconcile")
        try:  # before publishing: lanes follow pins; a failure must not stop the republishing below
            heal_pins(session, redis_client=client, settings=settings)
        except Exception as exc:
            session.rollback()
            log.warning("reconciler.heal_pins_failed", error=f"{type(exc).__name__}: {exc}")
        release_orphaned_deliveries(session, redis_client=client, settings=settings)
        release_lost_messages(session, redis_client=client, settings=settings)
        purge_dead_messages(client)  # cancelled jobs' messages leave the lists (bounded per tick)
        promoted = promote_aged_jobs(session, app=get_celery_app(), redis_client=client, settings=settings)
        return promoted + enqueue_due_jobs(session, app=get_celery_app(), redis_client=client,
                                           settings=settings)


@shared_task(name="cloverq.reap", **MAINTENANCE_TASK_OPTIONS)
def reap_task() -> int:
    session, client, settings = _resources()
    with session:
        return reap_expired_leases(session, redis_client=client, settings=settings).requeued


@shared_task(name="cloverq.expire", **MAINTENANCE_TASK_OPTIONS)
def expire_task() -> int:
    session, _client, settings = _resources()
    with session:
        return expire_finished_jobs(session, batch_size=settings.beat.expiry_batch)


@shared_task(name="cloverq.purge_data", **MAINTENANCE_TASK_OPTIONS)
def purge_data_task() -> int:
    """Data retention: purge the jobs whose retention passed, and expired ones' leftovers
    (``scheduler/maintenance/retention_tick.py``); and the tick claims past their margin."""
    session, client, settings = _resources()
    with session:
        purged = retention_tick.run_tick(session, redis_client=client, settings=settings).purged
        try:  # housekeeping: a failure here must not fail the purge above (the next tick retries)
            tick_claims.purge_expired(session, now=utcnow())
        except SQLAlchemyError as exc:
            session.rollback()
            log.warning("tick_claims.purge_failed", error=f"{type(exc).__name__}: {exc}")
        return purged
