"""Job service functions: submit, get, list, cancel, hot progress.

Keyword-only, session passed in, no HTTP: the API is a thin layer over these, and tests call
them directly. ``submit_job`` commits the row *before* publishing the message
(docs/architecture.md §3.1), so a crash or broker failure between the two leaves a queued row
that the reconciler publishes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, cast

import redis
import structlog
from celery import Celery
from sqlalchemy import Table, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, make_transient_to_detached

from scheduler.fairness.gate import forget_cancelled, publish_submitted, sessions_like
from scheduler.infra import redis_keys
from scheduler.infra.celery_app import get_celery_app
from scheduler.infra.db import rowcount
from scheduler.infra.keyset import newest_first_page, split_page
from scheduler.infra.redis_client import get_redis
from scheduler.infra.settings import Settings, get_settings
from scheduler.jobs.dead_messages import mark_dead
from scheduler.jobs.finished_notice import publish_finished
from scheduler.jobs.models import Job, JobStatus, as_utc, utcnow
from scheduler.jobs.routing import route_job
from scheduler.jobs.schedule import is_delayed, release_admission
from scheduler.model_versions.canary import current_route
from scheduler.model_versions.canary_routing import lane, route_version
from scheduler.observability import tracing
from scheduler.observability.metrics_recorder import RedisMetricsRecorder

MAX_LIST_LIMIT = 500

# Mapped attribute name -> column name (``meta`` is stored in the ``metadata`` column).
_ATTR_COLUMNS: dict[str, str] = {prop.key: prop.columns[0].key for prop in Job.__mapper__.column_attrs}

log = structlog.get_logger(__name__)


class IdempotencyConflictError(Exception):
    """The idempotency key was used before with a different request body."""

    def __init__(self, job: Job) -> None:
        super().__init__(f"idempotency key reused with a different request (job {job.id})")
        self.job = job


class InvalidCursorError(ValueError):
    """A list cursor that this service did not produce."""


def request_fingerprint(
    *, kind: str, input: Any, params: Any, priority: str | None, metadata: Any, webhook_url: str | None,
    schedule: str | None = None, webhook_events: str | None = None,
) -> str:
    """sha256 of the canonical request, to tell an idempotent repeat from a conflicting reuse.
    ``schedule`` / ``webhook_events`` count only when given, so older fingerprints stay valid."""
    request: dict[str, Any] = {"kind": kind, "input": input, "params": params, "priority": priority,
                               "metadata": metadata, "webhook_url": webhook_url}
    if schedule is not None:
        request["schedule"] = schedule
    if webhook_events is not None:
        request["webhook_events"] = webhook_events
    canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _parse_id(job_id: uuid.UUID | str) -> uuid.UUID | None:
    if isinstance(job_id, uuid.UUID):
        return job_id
    try:
        return uuid.UUID(str(job_id))
    except ValueError:
        return None


def _find_by_key(session: Session, *, tenant: str, idempotency_key: str) -> Job | None:
    return session.scalars(
        select(Job).where(Job.tenant == tenant, Job.idempotency_key == idempotency_key)
    ).one_or_none()


def _repeat(existing: Job, fingerprint: str) -> tuple[Job, bool]:
    if existing.request_fingerprint != fingerprint:
        raise IdempotencyConflictError(existing)
    return existing, False


def submit_job(
    session: Session,
    *,
    tenant: str,
    kind: str,
    input: Mapping[str, Any],
    params: Mapping[str, Any],
    priority: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    idempotency_key: str | None = None,
    webhook_url: str | None = None,
    request_id: str | None = None,
    batch_id: uuid.UUID | None = None,
    settings: Settings | None = None,
    celery: Celery | None = None,
    redis_client: redis.Redis | None = None,
    publish: bool = True,
    job_id: uuid.UUID | None = None,
    marker_set: bool = False,
    scheduled_for: datetime | None = None,
    schedule_request: str | None = None,
    webhook_events: str | None = None,
    retention_seconds: int | None = None,
    prompt_tokens: int = 0,
) -> tuple[Job, bool]:
    """Create a queued job (committed), then publish its message. Returns ``(job, created)``.

    A repeat with the same ``idempotency_key`` (per tenant) and the same body returns the
    original job with ``created=False``; a different body raises ``IdempotencyConflictError``.
    Raises ``scheduler.jobs.routing.InvalidPriorityError`` for an unknown ``priority``.
    ``publish=False`` leaves publishing to the reconciler (batch submission). ``job_id``: the
    new job's id when the caller chose it (default: a fresh uuid4); ``marker_set``: the caller
    already set that id's enqueued marker and its admission reservations (the API's admission
    does; the message releases them).
    ``scheduled_for``: a delayed job's start (``scheduler/jobs/schedule.py``): still in the future
    at the commit, its message is not sent (the beat's delayed tick sends it when due) and the
    admission's reservations are released instead; ``schedule_request``: the client's
    ``not_before`` / ``delay_seconds`` as given (the fingerprint's, not a time); ``webhook_events``:
    the stored filter (``scheduler/webhooks/events.py``). ``retention_seconds``: the job's data
    retention, already resolved against its tenant's policy (``scheduler/access/retention.py``).
    ``prompt_tokens``: the input's tokens as the API counted them (the routing cost counts them).
    """
    settings = settings or get_settings()
    fingerprint = request_fingerprint(
        kind=kind, input=input, params=params, priority=priority, metadata=metadata,
        webhook_url=webhook_url, schedule=schedule_request, webhook_events=webhook_events,
    )
    if idempotency_key is not None:
        existing = _find_by_key(session, tenant=tenant, idempotency_key=idempotency_key)
        if existing is not None:
            return _repeat(existing, fingerprint)

    route = route_job(kind=kind, input=input, params=params, priority=priority, settings=settings,
                      prompt_tokens=prompt_tokens)
    job_id = job_id or uuid.uuid4()
    canary = current_route(session, settings.model.served)  # None without a canary: no pin
    routed_version = route_version(job_id, canary)
    now = utcnow()
    row: dict[str, Any] = dict.fromkeys(_ATTR_COLUMNS)  # every attribute loaded: no lazy refresh later
    row.update(
        id=job_id,
        tenant=tenant,
        kind=str(kind),
        status=JobStatus.QUEUED.value,
        priority=route.priority.value,
        queue=route.queue.value,
        cost=route.cost,
        input=dict(input),
        params=dict(params),
        meta=dict(metadata) if metadata is not None else None,
        step_budget=params.get("step_budget"),
        steps_used=0,
        attempt=0,
        max_attempts=settings.jobs.max_attempts,
        cancel_requested=False,
        idempotency_key=idempotency_key,
        request_fingerprint=fingerprint,
        request_id=request_id,
        webhook_url=webhook_url,
        webhook_events=webhook_events,
        batch_id=batch_id,
        routed_version=routed_version,
        created_at=now,
        available_at=max(now, scheduled_for) if scheduled_for is not None else now,
        scheduled_for=scheduled_for,
        updated_at=now,
        retention_seconds=retention_seconds,
    )
    ids = tracing.recorded_ids() if tracing.enabled() else None  # the submit span: the job's trace
    if ids is not None:
        row.update(trace_id=ids[0], trace_span_id=ids[1])
    try:
        # One Core INSERT (the ORM unit of work costs ~3x the CPU on this hot path), then the
        # row is attached as a persistent object so callers can use the session as usual.
        # None values are left out (SQL NULL, as the ORM writes an unset attribute; never JSON null).
        with tracing.step("cloverq.sql.insert_commit"):
            session.execute(insert(cast(Table, Job.__table__)),
                            {_ATTR_COLUMNS[name]: value for name, value in row.items() if value is not None})
            session.commit()
    except IntegrityError:
        session.rollback()
        if idempotency_key is None:
            raise
        existing = _find_by_key(session, tenant=tenant, idempotency_key=idempotency_key)
        if existing is None:
            raise
        return _repeat(existing, fingerprint)
    job = Job(**row)
    make_transient_to_detached(job)
    session.add(job)

    if publish and is_delayed(scheduled_for, utcnow()):  # due later: the delayed tick publishes it
        if marker_set:
            _release_admission(redis_client or get_redis(settings.resolved_redis_url), job)
    elif publish:  # at once, or held by fair share and released by DRR (scheduler/fairness/gate.py)
        publish_submitted(
            job,
            settings=settings,
            app=celery or get_celery_app(),
            redis_client=redis_client or get_redis(settings.resolved_redis_url),
            request_id=request_id,
            marker_set=marker_set,  # its admission reservations: released by its message, or when held
            job_lane=lane(job.queue, routed_version, canary),
            sessions=sessions_like(session),
        )
    return job, True


def _release_admission(client: redis.Redis, job: Job) -> None:
    try:
        release_admission(client, tenant=job.tenant, jobs=[(job.id, job.queue)])
    except redis.RedisError as exc:  # see release_admission: they expire
        log.warning("job.admission_release_failed", job_id=str(job.id), error=type(exc).__name__)


def get_job(session: Session, *, job_id: uuid.UUID | str, tenant: str | None) -> Job | None:
    """The job, or None when it does not exist or belongs to another tenant (None = admin)."""
    parsed = _parse_id(job_id)
    if parsed is None:
        return None
    job = session.get(Job, parsed, populate_existing=True)
    if job is None or (tenant is not None and job.tenant != tenant):
        return None
    return job


def encode_cursor(job: Job) -> str:
    raw = f"{job.created_at.isoformat()}|{job.id}"
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        created, job_id = base64.urlsafe_b64decode(padded.encode()).decode().split("|", 1)
        # as_utc: a crafted cursor with a naive or out-of-range time is invalid, never a 5xx.
        return as_utc(datetime.fromisoformat(created)), uuid.UUID(job_id)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidCursorError("invalid cursor") from exc


def list_jobs(
    session: Session,
    *,
    tenant: str | None,
    status: str | None = None,
    kind: str | None = None,
    queue: str | None = None,
    created_after: datetime | None = None,
    created_before: datetime | None = None,
    batch_id: uuid.UUID | None = None,
    cursor: str | None = None,
    limit: int = 50,
) -> tuple[list[Job], str | None]:
    """Newest first, keyset-paginated: ``(jobs, next_cursor)``; ``next_cursor`` None at the end.

    ``tenant=None`` lists every tenant (admin). Raises ``InvalidCursorError`` for a bad cursor.
    """
    limit = max(1, min(int(limit), MAX_LIST_LIMIT))
    query = select(Job)
    if tenant is not None:
        query = query.where(Job.tenant == tenant)
    if status is not None:
        query = query.where(Job.status == str(status))
    if kind is not None:
        query = query.where(Job.kind == str(kind))
    if queue is not None:
        query = query.where(Job.queue == str(queue))
    if created_after is not None:
        query = query.where(Job.created_at >= created_after)
    if created_before is not None:
        query = query.where(Job.created_at < created_before)
    if batch_id is not None:
        query = query.where(Job.batch_id == batch_id)
    after = decode_cursor(cursor) if cursor is not None else None
    page = newest_first_page(query, created_at=Job.created_at, id_=Job.id, after=after, limit=limit)
    rows, more = split_page(list(session.scalars(page)), limit)
    return rows, encode_cursor(rows[-1]) if more else None


def cancel_job(
    session: Session,
    *,
    job_id: uuid.UUID | str,
    tenant: str | None,
    settings: Settings | None = None,
    redis_client: redis.Redis | None = None,
) -> Job | None:
    """Cancel a job: queued -> ``cancelled`` at once; running -> flagged + Redis signal.

    The worker watching a running job sees the signal and sets the engine request's cancel
    event, which the engine checks every denoising pass. A finished job is returned unchanged.
    Returns None when the job does not exist for this tenant.
    """
    settings = settings or get_settings()
    job = get_job(session, job_id=job_id, tenant=tenant)
    if job is None:
        return None
    now = utcnow()
    cancelled_queued = rowcount(session.execute(
        update(Job)
        .where(Job.id == job.id, Job.status == JobStatus.QUEUED.value)
        .values(status=JobStatus.CANCELLED.value, cancel_requested=True, finished_at=now,
                updated_at=now, expires_at=_expiry(now, settings))
    ))
    if not cancelled_queued:
        session.execute(
            update(Job)
            .where(Job.id == job.id, Job.status == JobStatus.RUNNING.value)
            .values(cancel_requested=True, updated_at=now)
        )
    session.commit()
    job = get_job(session, job_id=job.id, tenant=tenant)
    assert job is not None
    if job.status == JobStatus.RUNNING.value:
        client = redis_client or get_redis(settings.resolved_redis_url)
        try:
            client.set(redis_keys.cancel(job.id), "1", ex=redis_keys.CANCEL_TTL_SECONDS)
        except redis.RedisError as exc:  # the SQL flag is durable: the worker sees it at lease renewal
            log.warning("job.cancel_signal_failed", job_id=str(job.id), error=repr(exc))
    elif cancelled_queued:  # finished here, never reached a worker: count it like a worker would
        client = redis_client or get_redis(settings.resolved_redis_url)
        forget_cancelled(client, job)  # held by fair share: out of the index (it has no message)
        try:  # its waiting message no longer counts as depth and is skipped or purged
            mark_dead(client, [job.id])
        except redis.RedisError as exc:  # the claim still refuses it; the depth over-counts until taken
            log.warning("job.mark_dead_failed", job_id=str(job.id), error=type(exc).__name__)
        publish_finished(client, job.id)
        recorder = RedisMetricsRecorder(client)
        recorder.safe(recorder.job_finished, kind=job.kind, queue=job.queue, status=JobStatus.CANCELLED.value,
                      wait_seconds=None, run_seconds=None, steps_used=None, tokens=None)
    return job


def _expiry(now: datetime, settings: Settings) -> datetime:
    return now + timedelta(seconds=settings.jobs.result_ttl_seconds)


def read_progress(
    job_id: uuid.UUID | str, *, redis_client: redis.Redis | None = None, settings: Settings | None = None
) -> dict[str, Any] | None:
    """Hot status written by the worker at block boundaries, or None when there is none.

    Keys: ``status``, ``attempt``, ``blocks_done``, ``steps_used``, ``step_budget``,
    ``tokens_committed``, ``partial_text``, ``updated_at`` (unix seconds).
    """
    client = redis_client or get_redis((settings or get_settings()).resolved_redis_url)
    try:
        raw = client.get(redis_keys.progress(job_id))
    except redis.RedisError as exc:  # hot status is optional: SQL still has status and coarse progress
        log.warning("job.progress_unavailable", job_id=str(job_id), error=repr(exc))
        return None
    return json.loads(raw) if raw else None
