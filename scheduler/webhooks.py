"""Webhooks: a signed POST when a job (or a whole batch) finishes, retried with backoff.

Delivery is an outbox: finishing a job inserts a ``webhook_deliveries`` row (unique per event
and job/batch, so a duplicate finish never sends twice) and publishes
``cloverq.deliver_webhook(delivery_id)`` to the separate ``webhooks`` queue, consumed by the
light (model-less) worker — a slow or dead endpoint can never hold a GPU worker's thread.
A failed POST is retried with exponential backoff; after ``webhook_max_attempts`` the delivery
is ``given_up``. The job row is never touched by any of this.

Signature: ``X-Cloverq-Signature: t=<unix ts>,v1=<hex HMAC-SHA256(secret, "<ts>." + body)>``,
with a per-tenant secret (``webhook_secrets``; ``GET /v1/webhooks/secret`` shows it to the
tenant). Receivers recompute the HMAC over the raw body and reject old timestamps (replays).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import random
import secrets
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
import structlog
from sqlalchemy import Index, Integer, String, Text, UniqueConstraint, Uuid, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from scheduler.models import Base, Job, JobStatus, JSONType, UTCDateTime, utcnow
from scheduler.settings import Settings

log = structlog.get_logger(__name__)

WEBHOOKS_QUEUE = "webhooks"
DELIVER_WEBHOOK_TASK = "cloverq.deliver_webhook"
SIGNATURE_HEADER = "X-Cloverq-Signature"
EVENT_HEADER = "X-Cloverq-Event"
DELIVERY_HEADER = "X-Cloverq-Delivery"
DEFAULT_TOLERANCE_SECONDS = 300


class WebhookEvent(enum.StrEnum):
    JOB_FINISHED = "job.finished"
    BATCH_FINISHED = "batch.finished"


class DeliveryStatus(enum.StrEnum):
    PENDING = "pending"
    DELIVERED = "delivered"
    GIVEN_UP = "given_up"


class WebhookSecret(Base):
    """The signing secret of one tenant (created on first use)."""

    __tablename__ = "webhook_secrets"

    tenant: Mapped[str] = mapped_column(String(128), primary_key=True)
    secret: Mapped[str] = mapped_column(String(128), nullable=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)


class WebhookDelivery(Base):
    """One notification to send (the outbox row) and how its attempts went."""

    __tablename__ = "webhook_deliveries"

    id: Mapped[uuid.UUID] = mapped_column(Uuid(as_uuid=True), primary_key=True, default=uuid.uuid4)
    tenant: Mapped[str] = mapped_column(String(128), nullable=False)
    event: Mapped[str] = mapped_column(String(32), nullable=False)
    job_id: Mapped[uuid.UUID | None] = mapped_column(Uuid(as_uuid=True), nullable=True)
    batch_id: Mapped[uuid.UUID | None] = mapped_column(Uuid(as_uuid=True), nullable=True)
    url: Mapped[str] = mapped_column(Text, nullable=False)
    payload: Mapped[dict[str, Any]] = mapped_column(JSONType, nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False, default=DeliveryStatus.PENDING.value)
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    __table_args__ = (
        UniqueConstraint("event", "job_id", name="uq_webhook_deliveries_event_job"),
        UniqueConstraint("event", "batch_id", name="uq_webhook_deliveries_event_batch"),
        Index("ix_webhook_deliveries_status_next", "status", "next_attempt_at"),
    )


# --- signing ------------------------------------------------------------------------------------


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """Hex HMAC-SHA256 of ``"<timestamp>." + body`` under ``secret``."""
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def signature_header(secret: str, timestamp: int, body: bytes) -> str:
    """The ``X-Cloverq-Signature`` value: ``t=<ts>,v1=<hex>``."""
    return f"t={timestamp},v1={sign(secret, timestamp, body)}"


def verify_signature(
    secret: str, header: str, body: bytes, *, tolerance_seconds: float = DEFAULT_TOLERANCE_SECONDS,
    now: float | None = None,
) -> bool:
    """What a receiver does: check the HMAC (constant time) and that the timestamp is fresh."""
    try:
        parts = dict(item.split("=", 1) for item in header.split(","))
        timestamp = int(parts["t"])
        given = parts["v1"]
    except (KeyError, ValueError):
        return False
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance_seconds:
        return False
    return hmac.compare_digest(given, sign(secret, timestamp, body))


def tenant_secret(session: Session, *, tenant: str) -> str:
    """The tenant's signing secret, created (and committed) on first use."""
    row = session.get(WebhookSecret, tenant)
    if row is not None:
        return row.secret
    try:
        with session.begin_nested():
            session.add(WebhookSecret(tenant=tenant, secret=secrets.token_hex(32), created_at=utcnow()))
    except IntegrityError:  # created concurrently: use the winner's
        pass
    session.commit()
    row = session.get(WebhookSecret, tenant, populate_existing=True)
    assert row is not None
    return row.secret


def rotate_secret(session: Session, *, tenant: str) -> str:
    """Replace the tenant's secret (deliveries signed from now on use the new one)."""
    row = session.get(WebhookSecret, tenant)
    fresh = secrets.token_hex(32)
    if row is None:
        session.add(WebhookSecret(tenant=tenant, secret=fresh, created_at=utcnow()))
    else:
        row.secret, row.created_at = fresh, utcnow()
    session.commit()
    return fresh


# --- outbox ------------------------------------------------------------------------------------


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


def _insert_once(session: Session, delivery: WebhookDelivery) -> uuid.UUID | None:
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
    if job.webhook_url:
        delivery_id = _insert_once(
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
            delivery_id = _insert_once(
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


# --- delivery ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeliveryStep:
    """Outcome of one attempt: the status now, and when to try again (None = done)."""

    status: DeliveryStatus
    retry_in_seconds: float | None
    status_code: int | None = None
    error: str | None = None


def backoff_seconds(attempts: int, settings: Settings) -> float:
    """Delay before attempt ``attempts + 1``: base * 2^(attempts-1), capped, +0-25% jitter."""
    base = settings.webhook_backoff_base_seconds * (2 ** max(0, attempts - 1))
    return min(settings.webhook_backoff_max_seconds, base) * random.uniform(1.0, 1.25)


def _post(url: str, body: bytes, headers: Mapping[str, str], timeout: float) -> tuple[int | None, str | None]:
    try:
        response = httpx.post(url, content=body, headers=dict(headers), timeout=timeout)
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if 200 <= response.status_code < 300:
        return response.status_code, None
    return response.status_code, f"HTTP {response.status_code}"


def deliver_once(
    sessions: sessionmaker[Session], *, delivery_id: uuid.UUID | str, settings: Settings
) -> DeliveryStep:
    """Try one POST of a pending delivery and record the attempt (fenced on ``attempts``)."""
    with sessions() as session:
        delivery = session.get(WebhookDelivery, uuid.UUID(str(delivery_id)))
        if delivery is None or delivery.status != DeliveryStatus.PENDING.value:
            status = DeliveryStatus(delivery.status) if delivery else DeliveryStatus.GIVEN_UP
            return DeliveryStep(status=status, retry_in_seconds=None)
        secret = tenant_secret(session, tenant=delivery.tenant)
        body = json.dumps(delivery.payload, sort_keys=True, separators=(",", ":")).encode()
        headers = {
            "Content-Type": "application/json",
            SIGNATURE_HEADER: signature_header(secret, int(time.time()), body),
            EVENT_HEADER: delivery.event,
            DELIVERY_HEADER: str(delivery.id),
            "User-Agent": "cloverq-webhooks/1",
        }
        url, seen_attempts = delivery.url, delivery.attempts

    code, error = _post(url, body, headers, settings.webhook_timeout_seconds)
    attempts = seen_attempts + 1
    now = utcnow()
    if error is None:
        step = DeliveryStep(DeliveryStatus.DELIVERED, None, code)
    elif attempts >= settings.webhook_max_attempts:
        step = DeliveryStep(DeliveryStatus.GIVEN_UP, None, code, error)
    else:
        step = DeliveryStep(DeliveryStatus.PENDING, backoff_seconds(attempts, settings), code, error)
    next_at = now + timedelta(seconds=step.retry_in_seconds or 0)
    with sessions() as session:
        updated = session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.id == uuid.UUID(str(delivery_id)),
                   WebhookDelivery.attempts == seen_attempts,
                   WebhookDelivery.status == DeliveryStatus.PENDING.value)
            .values(attempts=attempts, status=step.status.value, last_status_code=code, last_error=error,
                    next_attempt_at=next_at,
                    finished_at=None if step.status is DeliveryStatus.PENDING else now)
        ).rowcount
        session.commit()
    if not updated:  # a duplicate message raced us and recorded this attempt: let it drive retries
        return DeliveryStep(step.status, None, code, error)
    event = "webhook.delivered" if error is None else "webhook.attempt_failed"
    if step.status is DeliveryStatus.GIVEN_UP:
        event = "webhook.given_up"
    log.info(event, delivery_id=str(delivery_id), attempt=attempts, status_code=code, error=error,
             retry_in=step.retry_in_seconds)
    return step


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
