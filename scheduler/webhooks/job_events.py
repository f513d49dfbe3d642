"""Webhooks of a running job: ``job.started`` at its claim, ``job.progress`` while it runs.

Sent only to jobs whose ``webhook_events`` name them (``scheduler/webhooks/events.py``). Both are
outbox rows like ``job.finished``: a ``webhook_deliveries`` row (unique per event, job and
``sequence``, so a duplicate never sends twice), committed, then ``cloverq.deliver_webhook``
published to the ``webhooks`` queue that the beat process consumes. ``job.started`` has sequence 0,
so a retried job (claimed again) announces its start once; ``job.progress`` uses the throttle's
time bucket (``scheduler/webhooks/progress.py``).

Who pays: the worker's task thread records ``job.started`` right after the claim commits, the
monitor thread records ``job.progress`` on its tick; one INSERT + commit + one publish, only for
jobs that asked. Never the engine thread, and never an exception: a webhook problem must not
touch the job (a lost ``job.started`` / ``job.progress`` is not swept again: they are moments,
and a late one would arrive after the job moved on).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import structlog
from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from scheduler.infra.celery_app import get_celery_app
from scheduler.jobs.models import Job, utcnow
from scheduler.webhooks.events import EventFilter, wants
from scheduler.webhooks.outbox import insert_once
from scheduler.webhooks.progress import ProgressThrottle, ProgressWebhook
from scheduler.webhooks.tables import DeliveryStatus, WebhookDelivery, WebhookEvent
from scheduler.webhooks.tasks import publish_delivery

log = structlog.get_logger(__name__)

# The counters a progress webhook carries (never text: the stream and GET have it).
PROGRESS_FIELDS = ("attempt", "blocks_done", "blocks_total", "steps_used", "step_budget", "tokens_committed")


def started_payload(job: Job) -> dict[str, Any]:
    return {
        "event": WebhookEvent.JOB_STARTED.value,
        "job": {
            "id": str(job.id), "kind": job.kind, "status": job.status, "attempt": job.attempt,
            "batch_id": str(job.batch_id) if job.batch_id else None, "metadata": job.meta,
            "started_at": job.started_at.isoformat() if job.started_at else None,
        },
    }


def progress_payload(job_id: uuid.UUID, hook: ProgressWebhook, snapshot: dict[str, Any]) -> dict[str, Any]:
    return {
        "event": WebhookEvent.JOB_PROGRESS.value,
        "job": {
            "id": str(job_id), "kind": hook.kind, "status": "running", "batch_id": hook.batch_id,
            "metadata": hook.metadata,
            "progress": {name: snapshot.get(name) for name in PROGRESS_FIELDS},
        },
    }


def progress_hook(job: Job, *, interval: float) -> ProgressWebhook | None:
    """The monitor's progress-webhook state of a job just claimed (None: it did not ask)."""
    if not job.webhook_url or not wants(job.webhook_events, EventFilter.PROGRESS):
        return None
    throttle = ProgressThrottle(interval, origin=job.created_at.timestamp())  # buckets: every attempt's
    return ProgressWebhook(tenant=job.tenant, url=job.webhook_url, kind=job.kind,
                           batch_id=str(job.batch_id) if job.batch_id else None, metadata=job.meta,
                           throttle=throttle)


def _delivery(*, tenant: str, event: WebhookEvent, job_id: uuid.UUID, url: str, payload: dict[str, Any],
              sequence: int = 0) -> WebhookDelivery:
    now = utcnow()
    return WebhookDelivery(id=uuid.uuid4(), tenant=tenant, event=event.value, job_id=job_id,
                           sequence=sequence, url=url, payload=payload, status=DeliveryStatus.PENDING.value,
                           attempts=0, next_attempt_at=now, created_at=now)


def _record(sessions: sessionmaker[Session], deliveries: Sequence[WebhookDelivery], app: Celery | None,
            *, what: str) -> int:
    try:
        with sessions() as session:
            ids = [delivery_id for delivery in deliveries
                   if (delivery_id := insert_once(session, delivery)) is not None]
            session.commit()
        for delivery_id in ids:
            publish_delivery(delivery_id, app=app or get_celery_app())
        return len(ids)
    except Exception as exc:  # never touches the job (see the module docstring)
        log.warning("webhook.record_failed", webhook_event=what, error=type(exc).__name__)  # no SQL params
        return 0


def notify_job_started(job: Job, *, sessions: sessionmaker[Session], app: Celery | None = None) -> int:
    """Record and publish ``job.started`` for a job just claimed, when its filter names it."""
    if not job.webhook_url or not wants(job.webhook_events, EventFilter.STARTED):
        return 0
    delivery = _delivery(tenant=job.tenant, event=WebhookEvent.JOB_STARTED, job_id=job.id,
                         url=job.webhook_url, payload=started_payload(job))
    return _record(sessions, [delivery], app, what=WebhookEvent.JOB_STARTED.value)


def notify_job_progress(
    items: Sequence[tuple[uuid.UUID, ProgressWebhook, int, dict[str, Any]]], *,
    sessions: sessionmaker[Session], app: Celery | None = None,
) -> int:
    """Record and publish ``job.progress`` for ``(job_id, hook, sequence, snapshot)`` each, in
    one transaction (the monitor's tick batches every running job that is due)."""
    if not items:
        return 0
    deliveries = [_delivery(tenant=hook.tenant, event=WebhookEvent.JOB_PROGRESS, job_id=job_id, url=hook.url,
                            payload=progress_payload(job_id, hook, snapshot), sequence=sequence)
                  for job_id, hook, sequence, snapshot in items]
    return _record(sessions, deliveries, app, what=WebhookEvent.JOB_PROGRESS.value)
