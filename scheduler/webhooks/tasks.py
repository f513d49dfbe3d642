"""Celery side of webhooks: the delivery task, the notify hook, and the outbox sweeper.

- ``notify_job_finished(job_id)`` is called by the worker right after it wrote a job's final
  outcome: it records the deliveries (outbox rows) and publishes them to the ``webhooks``
  queue. It never raises: a webhook problem must not touch the job.
- ``cloverq.deliver_webhook`` runs on the light beat process (``webhooks`` queue, threads
  pool), never on a GPU worker; a failed POST re-publishes itself with a backoff countdown.
- ``cloverq.sweep_webhooks`` (beat) records deliveries for final jobs/batches that finished on
  another path (cancelled while queued, failed by the reaper) and re-publishes pending
  deliveries whose message was lost. Every step is idempotent (unique outbox rows, fenced
  attempts).
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import structlog
from celery import Celery, Task, shared_task
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy import ColumnElement, exists, literal, or_, select
from sqlalchemy.orm import Session, sessionmaker

from scheduler.batches.service import Batch, batch_webhook
from scheduler.infra.celery_app import get_celery_app
from scheduler.infra.db import get_session_factory
from scheduler.infra.periodic_tick import TICK_TASK_OPTIONS
from scheduler.infra.queue_names import WEBHOOKS_QUEUE
from scheduler.infra.settings import Settings, get_settings
from scheduler.jobs.models import FINAL_STATUSES, Job, JobStatus, utcnow
from scheduler.observability import tracing
from scheduler.webhooks.delivery import DELIVER_WEBHOOK_TASK, deliver_once
from scheduler.webhooks.events import EventFilter
from scheduler.webhooks.outbox import due_deliveries, record_job_finished
from scheduler.webhooks.tables import WebhookDelivery, WebhookEvent

log = structlog.get_logger(__name__)

SWEEP_TASK = "cloverq.sweep_webhooks"
SWEEP_WINDOW = timedelta(days=1)  # final jobs older than this are not looked at again
SWEEP_LIMIT = 500


def _sessions(settings: Settings) -> sessionmaker[Session]:
    return get_session_factory(settings.resolved_database_url)


def _app() -> Celery:
    return get_celery_app()


def publish_delivery(delivery_id: uuid.UUID | str, *, app: Celery, countdown: float | None = None) -> None:
    """Send ``cloverq.deliver_webhook(delivery_id)`` to the ``webhooks`` queue (with the current
    span's ``traceparent``: the worker's attempt that finished the job, or the previous delivery)."""
    headers: dict[str, object] = {}
    tracing.inject(headers)
    app.send_task(DELIVER_WEBHOOK_TASK, args=[str(delivery_id)], queue=WEBHOOKS_QUEUE,
                  routing_key=WEBHOOKS_QUEUE, countdown=countdown, headers=headers or None)


def record_and_publish(session: Session, jobs: list[Job], *, app: Celery) -> int:
    """Record the deliveries ``jobs`` (final) trigger, commit, publish them. Returns how many."""
    ids = []
    for job in jobs:
        ids.extend(record_job_finished(session, job=job, batch_payload=batch_webhook))
    session.commit()
    for delivery_id in ids:
        publish_delivery(delivery_id, app=app)
    return len(ids)


def notify_job_finished(
    job_id: uuid.UUID | str, *, sessions: sessionmaker[Session] | None = None, app: Celery | None = None,
    settings: Settings | None = None,
) -> int:
    """Hook for the worker's finish path (cheap: a few SQL statements, no HTTP). Never raises."""
    try:
        settings = settings or get_settings()
        with (sessions or _sessions(settings))() as session:
            job = session.get(Job, uuid.UUID(str(job_id)))
            if job is None or not JobStatus(job.status).is_final:
                return 0
            if not job.webhook_url and not job.batch_id:
                return 0
            return record_and_publish(session, [job], app=app or _app())
    except Exception as exc:  # the sweeper retries; a webhook problem never touches the job
        log.warning("webhook.notify_failed", job_id=str(job_id), error=f"{type(exc).__name__}: {exc}")
        return 0


def sweep(session: Session, *, app: Celery, settings: Settings) -> int:
    """Record missing deliveries of recently final jobs/batches; re-publish lost pending ones."""
    since = utcnow() - SWEEP_WINDOW
    final = [s.value for s in FINAL_STATUSES]
    delivered_job = exists().where(WebhookDelivery.event == WebhookEvent.JOB_FINISHED.value,
                                   WebhookDelivery.job_id == Job.id)
    jobs = list(session.scalars(
        select(Job).where(Job.webhook_url.is_not(None), Job.status.in_(final), Job.finished_at >= since,
                          ~delivered_job, _wants_its_finish()).limit(SWEEP_LIMIT)
    ))
    delivered_batch = exists().where(WebhookDelivery.event == WebhookEvent.BATCH_FINISHED.value,
                                     WebhookDelivery.batch_id == Batch.id)
    unfinished = exists().where(Job.batch_id == Batch.id, Job.status.in_(
        (JobStatus.QUEUED.value, JobStatus.RUNNING.value)))
    batch_ids = list(session.scalars(
        select(Batch.id).where(Batch.webhook_url.is_not(None), Batch.created_at >= since - SWEEP_WINDOW,
                               ~delivered_batch, ~unfinished, _wants_named(
                                   Batch.webhook_events, EventFilter.BATCH_COMPLETED.value))
        .limit(SWEEP_LIMIT)
    ))
    # One final job of each finished batch stands for the batch (recording is unique per batch).
    for batch_id in batch_ids:
        member = session.scalars(select(Job).where(Job.batch_id == batch_id).limit(1)).first()
        if member is not None and member not in jobs:
            jobs.append(member)
    recorded = record_and_publish(session, jobs, app=app) if jobs else 0
    lost = due_deliveries(session, older_than_seconds=max(60.0, 2 * settings.webhooks.timeout_seconds))
    for delivery_id in lost:
        publish_delivery(delivery_id, app=app)
    if recorded or lost:
        log.info("webhook.sweep", recorded=recorded, republished=len(lost))
    return recorded + len(lost)


def _wants_named(column: Any, name: Any) -> ColumnElement[bool]:
    """SQL of ``events.wants``: no filter (the default, which wants every final event and
    ``batch_completed``), or ``name`` among its space-separated names. The sweep must skip rows
    whose filter declines their event, or they would fill its ``SWEEP_LIMIT`` on every tick."""
    padded = literal(" ") + column + literal(" ")
    return or_(column.is_(None), padded.like(literal("% ") + name + literal(" %")))


def _wants_its_finish() -> ColumnElement[bool]:
    """The final job's filter names its status (``succeeded`` / ``failed`` / ``cancelled``)."""
    return _wants_named(Job.webhook_events, Job.status)


@shared_task(name=DELIVER_WEBHOOK_TASK, bind=True, ignore_result=True)
def deliver_webhook_task(self: Task, delivery_id: str) -> str:
    """One POST attempt; schedules the next one (countdown) when it failed and attempts remain.

    Traced as ``cloverq.webhook.deliver`` in the trace of the job that triggered it (none when the
    message carried no trace: a sweep's re-publish of a lost delivery)."""
    settings = get_settings()
    parent = tracing.from_task_request(self.request)
    with tracing.job_span("cloverq.webhook.deliver", parent, kind=SpanKind.CONSUMER,
                          **{"cloverq.webhook.delivery_id": str(delivery_id)}) as span:
        step = deliver_once(_sessions(settings), delivery_id=delivery_id, settings=settings)
        if span is not None:
            span.set_attribute("cloverq.webhook.status", step.status.value)
            if step.retry_in_seconds is not None:
                span.set_status(StatusCode.ERROR, "delivery failed; retried later")
        if step.retry_in_seconds is not None:
            publish_delivery(delivery_id, app=_app(), countdown=step.retry_in_seconds)
    return step.status.value


@shared_task(name=SWEEP_TASK, **TICK_TASK_OPTIONS)  # a periodic tick: see maintenance
def sweep_webhooks_task() -> int:
    settings = get_settings()
    with _sessions(settings)() as session:
        return sweep(session, app=_app(), settings=settings)
