"""The webhook tables: the outbox of deliveries and the tenants' signing secrets.

``webhook_deliveries`` is the outbox: one row per notification to send, unique per event and
job (and ``sequence``) or batch, so a duplicate finish never sends twice; ``outbox.py`` inserts
the rows, ``delivery.py`` records each attempt on them. ``webhook_secrets`` holds one signing
secret per tenant (``signing.py``).
"""

from __future__ import annotations

import enum
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import Index, Integer, String, Text, UniqueConstraint, Uuid, text
from sqlalchemy.orm import Mapped, mapped_column

from scheduler.jobs.models import Base, JSONType, UTCDateTime, utcnow


class WebhookEvent(enum.StrEnum):
    """What the receiver sees in ``X-Cloverq-Event`` (which filter sends which: ``events.py``)."""

    JOB_FINISHED = "job.finished"
    BATCH_FINISHED = "batch.finished"
    JOB_STARTED = "job.started"  # only with webhook_events naming "started"
    JOB_PROGRESS = "job.progress"  # only with "progress"


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
    # 0 for every event but ``job.progress``, whose deliveries of one job are numbered (the
    # throttle's time bucket, scheduler/webhooks/progress.py): unique per event, job and sequence.
    sequence: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default=text("0"))
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
        UniqueConstraint("event", "job_id", "sequence", name="uq_webhook_deliveries_event_job_sequence"),
        UniqueConstraint("event", "batch_id", name="uq_webhook_deliveries_event_batch"),
        Index("ix_webhook_deliveries_status_next", "status", "next_attempt_at"),
    )
