"""The webhook outbox: the delivery rows a finished job (or batch) inserts, and the overdue ones.

Finishing a job inserts a ``webhook_deliveries`` row (``insert_once``: unique per event and
job/batch, so a duplicate finish never sends twice); the caller commits, then publishes
``cloverq.deliver_webhook(delivery_id)`` (``tasks.py``). A delivery whose message was lost is
found again by ``due_deliveries`` (the sweeper). The job row is never touched by any of this.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from scheduler.jobs.models import Job, JobStatus, utcnow
from scheduler.webhooks.events import wants_final
from scheduler.webhooks.tables import DeliveryStatus, WebhookDelivery, WebhookEvent


def job_payload(job: Job) -> dict[str, Any]:
    """What a job webhook carries: enough to act without polling."""
    return {
        "event": WebhookEvent.JOB_FINISHED.value,
        "job": {
            "id": str(job.id),
            "kind": job.kind,
            "status": job.status,
            "batch_id": str(job.batch_id) if job.batch_id else None,
            "metadata": job.meta,
            "result": job.result,
            "error": {"code": job.error_code, "message": job.error_message} if job.error_code else None,
            "finished_at": job.finished_at.isoformat() if job.finished_at else None,
        },
    }


def insert_once(session: Session, delivery: WebhookDelivery) -> uuid.UUID | None:
    """Add ``delivery`` unless its event was recorded already (then None): the outbox's one INSERT."""
    try:
        with session.begin_nested():
            session.add(delivery)
    except IntegrityError:  # this event was already recorded (duplicate finish)
        return None
    return delivery.id


def record_job_finished(
    session: Session, *, job: Job, batch_payload: Callable[[Session, uuid.UUID], tuple[str, dict] | None]
    | None = None,
) -> list[uuid.UUID]:
    """Insert the deliveries a finished job triggers (its own, and its batch's when it was the
    batch's last). The caller commits, then publishes the returned ids."""
    ids: list[uuid.UUID] = []
    now = utcnow()
    if job.webhook_url and wants_final(job.webhook_events, job.status):
        delivery_id = insert_once(
            session,
            WebhookDelivery(
                id=uuid.uuid4(), tenant=job.tenant, event=WebhookEvent.JOB_FINISHED.value, job_id=job.id,
                url=job.webhook_url, payload=job_payload(job), status=DeliveryStatus.PENDING.value,
                attempts=0, next_attempt_at=now, created_at=now,
            ),
        )
        if delivery_id:
            ids.append(delivery_id)
    if job.batch_id and batch_payload is not None:
        unfinished = session.scalar(
            select(func.count()).select_from(Job).where(
                Job.batch_id == job.batch_id,
                Job.status.in_((JobStatus.QUEUED.value, JobStatus.RUNNING.value)),
            )
        )
        built = batch_payload(session, job.batch_id) if not unfinished else None
        if built is not None:
            url, payload = built
            delivery_id = insert_once(
                session,
                WebhookDelivery(
                    id=uuid.uuid4(), tenant=job.tenant, event=WebhookEvent.BATCH_FINISHED.value,
                    batch_id=job.batch_id, url=url, payload=payload, status=DeliveryStatus.PENDING.value,
                    attempts=0, next_attempt_at=now, created_at=now,
                ),
            )
            if delivery_id:
                ids.append(delivery_id)
    return ids


def due_deliveries(session: Session, *, older_than_seconds: float, limit: int = 500) -> list[uuid.UUID]:
    """Pending deliveries overdue by ``older_than_seconds`` (their message was lost): the
    sweeper publishes them again."""
    cutoff = utcnow() - timedelta(seconds=older_than_seconds)
    return list(
        session.scalars(
            select(WebhookDelivery.id)
            .where(WebhookDelivery.status == DeliveryStatus.PENDING.value,
                   WebhookDelivery.next_attempt_at < cutoff)
            .limit(limit)
        )
    )
