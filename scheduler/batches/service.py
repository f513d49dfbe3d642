"""Batches: many job specs stored in ONE transaction, read back in submission order.

A batch is a row in ``batches`` plus one job per spec; ``batch_jobs`` keeps each job's index
in the submission, so results stream in that order with keyset pages (no long transaction,
constant memory). Batch jobs are pipeline work: they go to the ``bulk`` class (joint-mode
decisions keep their own ``joint`` queue, which is capped anyway). Messages are published
after the commit; a publish that fails leaves the rows queued for the reconciler.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import redis
import structlog
from celery import Celery
from opentelemetry.trace import SpanKind
from sqlalchemy import Boolean, ForeignKey, Integer, String, Text, Uuid, func, insert, select, update
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from scheduler.fairness import gate as fair_share
from scheduler.infra import redis_keys
from scheduler.infra.broker import admitted_headers, releases_reservations
from scheduler.infra.celery_app import RUN_JOB_TASK
from scheduler.infra.db import get_session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.dead_messages import mark_dead
from scheduler.jobs.models import Base, Job, JobStatus, JSONType, QueueName, UTCDateTime, utcnow
from scheduler.jobs.routing import Route, route_job
from scheduler.jobs.schedule import release_admission
from scheduler.jobs.service import request_fingerprint
from scheduler.model_versions.canary import current_route
from scheduler.model_versions.canary_routing import route_version
from scheduler.observability import tracing
from scheduler.webhooks import events as webhook_filters
from scheduler.webhooks.tables import WebhookEvent

log = structlog.get_logger(__name__)

BATCH_PRIORITY = QueueName.BULK.value
RESULTS_PAGE = 500


class Batch(Base):
    """One submitted batch."""

    __tablename__ = "batches"

    id: Mapped[uuid.UUID] = mapped_column(Uuid(as_uuid=True), primary_key=True, default=uuid.uuid4)
    tenant: Mapped[str] = mapped_column(String(128), nullable=False, index=True)
    total: Mapped[int] = mapped_column(Integer, nullable=False)
    webhook_url: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The events the batch's webhook wants (scheduler/webhooks/events.py); NULL: default.
    webhook_events: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # Every job of the batch starts no earlier than this (scheduler/jobs/schedule.py); NULL: now.
    scheduled_for: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONType, nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    request_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    # The retention its jobs got when they set none (scheduler/access/retention.py); when a tenant
    # purged every job's data at once (DELETE /v1/batches/{id}/data).
    retention_seconds: Mapped[int | None] = mapped_column(Integer, nullable=True)
    purged_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class BatchJob(Base):
    """A job's position in its batch's submission order."""

    __tablename__ = "batch_jobs"

    batch_id: Mapped[uuid.UUID] = mapped_column(
        Uuid(as_uuid=True), ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[uuid.UUID] = mapped_column(Uuid(as_uuid=True), nullable=False)


@dataclass(frozen=True)
class JobSpec:
    """One job of a batch (the same fields as ``POST /v1/jobs``, already validated)."""

    kind: str
    input: Mapping[str, Any]
    params: Mapping[str, Any]
    priority: str | None = None
    metadata: Mapping[str, Any] | None = None
    webhook_url: str | None = None
    retention_seconds: int | None = None  # resolved against the tenant's policy (api/retention.py)
    webhook_events: str | None = None  # stored form (scheduler/webhooks/events.py); with webhook_url
    prompt_tokens: int = 0  # the input's tokens as the API counted them (the routing cost)


class BatchStatus(enum.StrEnum):
    """A batch's status (derived from its jobs' statuses, never stored)."""

    RUNNING = "running"
    CANCELLING = "cancelling"  # cancel requested, some jobs not final yet
    COMPLETED = "completed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class BatchSummary:
    """A batch with its job counts by status."""

    batch: Batch
    counts: dict[str, int]

    @property
    def finished(self) -> int:
        return sum(n for status, n in self.counts.items() if JobStatus(status).is_final)

    @property
    def status(self) -> BatchStatus:
        """``cancelled`` / ``completed`` once every job is final, else ``running``."""
        if self.finished < self.batch.total:
            return BatchStatus.CANCELLING if self.batch.cancel_requested else BatchStatus.RUNNING
        return BatchStatus.CANCELLED if self.batch.cancel_requested else BatchStatus.COMPLETED


def batch_route(spec: JobSpec, settings: Settings) -> Route:
    """Where a batch job goes: ``bulk`` (joint-mode decisions: ``joint``). The API's batch
    admission checks the caps of exactly these queues."""
    # A client may lower the class further, never raise it above bulk (route_job only lowers).
    route = route_job(kind=spec.kind, input=spec.input, params=spec.params,
                      priority=spec.priority or BATCH_PRIORITY, settings=settings,
                      prompt_tokens=spec.prompt_tokens)
    if route.queue != QueueName.JOINT:
        route = Route(cost=route.cost, priority=QueueName.BULK, queue=QueueName.BULK)
    return route


def _job_row(spec: JobSpec, *, tenant: str, batch_id: uuid.UUID, settings: Settings, now: datetime,
             request_id: str | None, job_id: uuid.UUID | None = None,
             batch_webhook: tuple[str | None, str | None] = (None, None),
             scheduled_for: datetime | None = None) -> dict[str, Any]:
    """``batch_webhook``: the batch's URL and the job part of its filter, for a spec without a URL of
    its own (``scheduler/webhooks/events.py`` ``job_part``); ``scheduled_for``: the batch's start."""
    route = batch_route(spec, settings)
    url, events = (spec.webhook_url, spec.webhook_events) if spec.webhook_url else batch_webhook
    metadata = dict(spec.metadata) if spec.metadata is not None else None
    return {
        "id": job_id or uuid.uuid4(), "tenant": tenant, "kind": str(spec.kind),
        "status": JobStatus.QUEUED.value,
        "priority": route.priority.value, "queue": route.queue.value, "cost": route.cost,
        "input": dict(spec.input), "params": dict(spec.params), "meta": metadata,
        "step_budget": spec.params.get("step_budget"), "steps_used": 0, "attempt": 0,
        "max_attempts": settings.jobs.max_attempts, "cancel_requested": False, "idempotency_key": None,
        "request_fingerprint": request_fingerprint(
            kind=spec.kind, input=spec.input, params=spec.params, priority=spec.priority,
            metadata=spec.metadata, webhook_url=spec.webhook_url, webhook_events=spec.webhook_events,
        ),
        "request_id": request_id, "webhook_url": url if events else spec.webhook_url,
        "webhook_events": events, "batch_id": batch_id, "scheduled_for": scheduled_for,
        "retention_seconds": spec.retention_seconds,
        "created_at": now, "updated_at": now,
        "available_at": max(now, scheduled_for) if scheduled_for else now,  # a delayed batch: its start
    }


def create_batch(
    session: Session,
    *,
    tenant: str,
    specs: Sequence[JobSpec],
    settings: Settings,
    webhook_url: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    request_id: str | None = None,
    job_ids: Sequence[uuid.UUID] | None = None,
    retention_seconds: int | None = None,
    scheduled_for: datetime | None = None,
    webhook_events: str | None = None,
) -> tuple[Batch, list[tuple[uuid.UUID, str]]]:
    """Store the batch and all its jobs in one transaction (committed here).

    ``job_ids``: the jobs' ids, one per spec, when the caller chose them (the API's admission
    reserves them by id); default fresh uuid4s. ``scheduled_for``: no job starts before it (a
    delayed batch: ``hold_batch`` instead of ``publish_batch``); ``webhook_events``: the batch's
    filter (stored form); its job events go to the jobs without a webhook_url of their own.
    Returns the batch and ``(job_id, queue)`` in submission order, for ``publish_batch``.
    """
    if not specs:
        raise ValueError("a batch needs at least one job")
    if len(specs) > settings.batches.max_jobs:
        raise ValueError(f"a batch holds at most {settings.batches.max_jobs} jobs")
    if job_ids is not None and len(job_ids) != len(specs):
        raise ValueError("one job id per spec")
    now = utcnow()
    batch = Batch(id=uuid.uuid4(), tenant=tenant, total=len(specs), webhook_url=webhook_url,
                  meta=dict(metadata) if metadata is not None else None, cancel_requested=False,
                  request_id=request_id, created_at=now)
    batch.retention_seconds = retention_seconds  # its jobs' default; each spec carries its own
    batch.scheduled_for, batch.webhook_events = scheduled_for, webhook_events
    ids: Sequence[uuid.UUID | None] = job_ids if job_ids is not None else [None] * len(specs)
    inherited = (webhook_url, webhook_filters.job_part(webhook_events)) if webhook_url else (None, None)
    rows = [_job_row(spec, tenant=tenant, batch_id=batch.id, settings=settings, now=now,
                     request_id=request_id, job_id=job_id, batch_webhook=inherited,
                     scheduled_for=scheduled_for)
            for spec, job_id in zip(specs, ids, strict=True)]
    # A canary pins batch jobs too. Their messages go to the plain queue: a canary job's first
    # delivery is left queued by a stable worker and the reconciler moves it to its lane.
    canary = current_route(session, settings.model.served)
    for row in rows:
        row["routed_version"] = route_version(row["id"], canary)
    # One trace per batch: its jobs are parented to the upload request's span (a retry's republish
    # joins it through these ids), not one trace each (tracing.py: a 10,000-job upload would
    # build and export 10,000 spans on the request path).
    traced = tracing.recorded_ids() if tracing.enabled() else None
    if traced is not None:
        for row in rows:
            row.update(trace_id=traced[0], trace_span_id=traced[1])
    session.add(batch)
    session.flush()
    session.execute(insert(Job), rows)
    order = [{"batch_id": batch.id, "seq": i, "job_id": row["id"]} for i, row in enumerate(rows)]
    session.execute(insert(BatchJob), order)
    session.commit()
    return batch, [(row["id"], row["queue"]) for row in rows]


def hold_batch(jobs: Sequence[tuple[uuid.UUID, str]], *, redis_client: redis.Redis, tenant: str) -> None:
    """What a delayed batch does instead of ``publish_batch``: no message now (the beat's delayed
    tick publishes each job when due); the admission's reservations are released, SQL counts the
    jobs from here on (``scheduler/jobs/schedule.py``)."""
    try:
        release_admission(redis_client, tenant=tenant, jobs=jobs)
    except redis.RedisError as exc:  # they expire within a minute
        log.warning("batch.admission_release_failed", jobs=len(jobs), error=type(exc).__name__)


def publish_batch(
    jobs: Sequence[tuple[uuid.UUID, str]], *, app: Celery, redis_client: redis.Redis,
    request_id: str | None = None, tenant: str | None = None, settings: Settings | None = None,
    sessions: sessionmaker[Session] | None = None,
) -> int:
    """Publish every job's message after the commit: enqueued markers first (one pipeline, as
    ``scheduler.jobs.enqueue.publish_job`` does, so a fast worker's retry is never hidden), then the
    messages over ONE producer connection. On a broker failure the unsent jobs' markers are
    removed and the reconciler publishes them. ``tenant``: the API's admission reserved the
    jobs for it (by enqueued-marker key); each message releases its job's reservations
    (``scheduler.infra.broker``), unsent ones expire. Returns how many went out.

    With ``settings`` whose ``scheduling.fair_share`` is on, the jobs are held instead and released
    by deficit round robin as their class's window has room (``scheduler/fairness/gate.py``; its
    reservations dropped, held jobs count in the depth); ``sessions``: for reading them back.
    Returns how many were held then."""
    with tracing.span("cloverq.batch.publish", kind=SpanKind.PRODUCER,
                      attributes={"cloverq.batch.jobs": len(jobs)}):
        if settings is not None and fair_share.enabled(settings):
            # Each job's message then carries a publish span of its own, made by whichever process
            # releases it, in the job's trace (scheduler/fairness/release.py).
            readers = sessions or get_session_factory(settings.resolved_database_url)
            return fair_share.hold_committed_batch(jobs, settings=settings, sessions=readers, app=app,
                                                   redis_client=redis_client)
        return _publish_batch(jobs, app=app, redis_client=redis_client, request_id=request_id,
                              tenant=tenant)


def _publish_batch(
    jobs: Sequence[tuple[uuid.UUID, str]], *, app: Celery, redis_client: redis.Redis,
    request_id: str | None, tenant: str | None,
) -> int:
    base: dict[str, str | list[str]] = {"cloverq_request_id": request_id} if request_id else {}
    tracing.inject(base)  # one publish span for the whole batch: every job's attempt is its child
    release_here = tenant is not None and not releases_reservations(app)
    with redis_client.pipeline(transaction=False) as pipe:
        for job_id, queue in jobs:
            pipe.set(redis_keys.enqueued(job_id), queue, ex=redis_keys.ENQUEUED_TTL_SECONDS)
        pipe.execute()
    sent = 0
    try:
        with app.producer_or_acquire() as producer:
            for job_id, queue in jobs:
                headers = dict(base)
                if tenant is not None:
                    headers.update(admitted_headers(queue=queue, tenant=tenant, job_id=job_id))
                app.send_task(RUN_JOB_TASK, args=[str(job_id)], queue=queue, routing_key=queue,
                              producer=producer, headers=headers or None)
                sent += 1
    except Exception as exc:  # broker trouble: the rows are durable, the reconciler takes over
        log.warning("batch.publish_incomplete", sent=sent, total=len(jobs), error=repr(exc))
        unsent = [redis_keys.enqueued(job_id) for job_id, _ in jobs[sent:]]
        if unsent:
            redis_client.delete(*unsent)
    if release_here and sent:  # another transport than scheduler.infra.broker's: release them here
        assert tenant is not None
        with redis_client.pipeline(transaction=False) as pipe:
            for job_id, queue in jobs[:sent]:
                member = redis_keys.enqueued(job_id)
                pipe.zrem(redis_keys.queue_reservations(queue), member)
                pipe.zrem(redis_keys.tenant_reservations(tenant), member)
            pipe.execute()
    return sent


def get_batch(session: Session, *, batch_id: uuid.UUID | str, tenant: str | None) -> Batch | None:
    """The batch, or None if missing or another tenant's (``tenant=None``: admin)."""
    try:
        parsed = batch_id if isinstance(batch_id, uuid.UUID) else uuid.UUID(str(batch_id))
    except ValueError:
        return None
    batch = session.get(Batch, parsed, populate_existing=True)
    if batch is None or (tenant is not None and batch.tenant != tenant):
        return None
    return batch


def summarize(session: Session, batch: Batch) -> BatchSummary:
    """Counts by status (one GROUP BY over the batch's jobs)."""
    rows = session.execute(
        select(Job.status, func.count()).where(Job.batch_id == batch.id).group_by(Job.status)
    ).all()
    return BatchSummary(batch=batch, counts={status: int(n) for status, n in rows})


def result_line(seq: int, job: Job) -> dict[str, Any]:
    """One line of the results JSONL."""
    return {
        "index": seq,
        "job_id": str(job.id),
        "status": job.status,
        "metadata": job.meta,
        "result": job.result,
        "error": {"code": job.error_code, "message": job.error_message} if job.error_code else None,
    }


def iter_batch_jobs(
    sessions: sessionmaker[Session], *, batch_id: uuid.UUID, page: int = RESULTS_PAGE
) -> Iterator[tuple[int, Job]]:
    """``(seq, job)`` of every job of the batch in submission order, one short transaction per keyset
    page (``seq > last seen``, never OFFSET: a large batch is read without holding a transaction or
    rescanning). The jobs are detached; their column attributes stay loaded. The one pager of both
    batch APIs: cloverq's results JSONL (``iter_results``) and the OpenAI output file."""
    after = -1
    while True:
        with sessions() as session:
            rows = session.execute(
                select(BatchJob.seq, Job)
                .join(Job, Job.id == BatchJob.job_id)
                .where(BatchJob.batch_id == batch_id, BatchJob.seq > after)
                .order_by(BatchJob.seq)
                .limit(page)
            ).all()
            pairs = [(int(seq), job) for seq, job in rows]
            session.expunge_all()
        yield from pairs
        if len(rows) < page:
            return
        after = rows[-1][0]


def iter_results(
    sessions: sessionmaker[Session], *, batch_id: uuid.UUID, page: int = RESULTS_PAGE
) -> Iterator[dict[str, Any]]:
    """Every job of the batch in submission order as its results line (``iter_batch_jobs``' pages)."""
    for seq, job in iter_batch_jobs(sessions, batch_id=batch_id, page=page):
        yield result_line(seq, job)


def cancel_batch(
    session: Session, *, batch: Batch, settings: Settings, redis_client: redis.Redis
) -> BatchSummary:
    """Queued jobs -> ``cancelled`` in one UPDATE; running ones get the cancel flag and signal.

    A batch whose jobs are all final already is returned unchanged (``completed`` stays
    ``completed``), as a finished job is by its own cancel: there is nothing left to stop, and the
    flag would relabel finished work ``cancelled``. Its jobs are stored in one transaction with
    it, so once all of them are final none can come after."""
    already = summarize(session, batch)
    if already.finished >= batch.total:
        return already
    now = utcnow()
    batch.cancel_requested = True
    cancelled = list(session.scalars(
        update(Job)
        .where(Job.batch_id == batch.id, Job.status == JobStatus.QUEUED.value)
        .values(status=JobStatus.CANCELLED.value, cancel_requested=True, finished_at=now, updated_at=now,
                expires_at=now + timedelta(seconds=settings.jobs.result_ttl_seconds))
        .returning(Job.id)
    ))
    running = list(session.scalars(
        select(Job.id).where(Job.batch_id == batch.id, Job.status == JobStatus.RUNNING.value)
    ))
    if running:
        session.execute(update(Job).where(Job.id.in_(running)).values(cancel_requested=True, updated_at=now))
    session.commit()
    if cancelled:  # their waiting messages leave the depth count now and the lists at the next tick
        fair_share.forget_cancelled_batch(redis_client, tenant=batch.tenant, batch_id=batch.id)  # held ones
        try:
            mark_dead(redis_client, cancelled)
        except redis.RedisError as exc:  # the claim still refuses them; depth over-counts until taken
            log.warning("batch.mark_dead_failed", batch_id=str(batch.id), error=type(exc).__name__)
    if running:
        with redis_client.pipeline(transaction=False) as pipe:
            for job_id in running:
                pipe.set(redis_keys.cancel(job_id), "1", ex=redis_keys.CANCEL_TTL_SECONDS)
            pipe.execute()
    return summarize(session, batch)


def batch_webhook(session: Session, batch_id: uuid.UUID) -> tuple[str, dict[str, Any]] | None:
    """``(url, payload)`` of a finished batch's webhook, or None when it has no URL."""
    batch = session.get(Batch, batch_id)
    if batch is None or not batch.webhook_url:
        return None
    if not webhook_filters.wants(batch.webhook_events, webhook_filters.EventFilter.BATCH_COMPLETED,
                                 batch=True):
        return None  # its filter names only job events
    summary = summarize(session, batch)
    payload = {
        "event": WebhookEvent.BATCH_FINISHED.value,
        "batch": {"id": str(batch.id), "status": summary.status.value, "total": batch.total,
                  "counts": summary.counts, "metadata": batch.meta},
    }
    return batch.webhook_url, payload
