"""The job table (the system of record) and the enums of the job domain.

SQL holds every job's state; Redis only carries messages and hot progress. The columns are the
ones the API exposes plus the bookkeeping the worker needs for fenced claims (``attempt``,
``lease_deadline``) and the beat tasks need for recovery (``available_at``, ``expires_at``).
"""

from __future__ import annotations

import enum
import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    Uuid,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from scheduler.infra.queue_names import QueueName as QueueName

# Enums of the job domain defined in leaf modules (no SQL there), re-exported here.
from scheduler.jobs.error_codes import ErrorCode as ErrorCode

# Stable constraint names so Alembic revisions can refer to them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """Declarative base of every cloverq table (other modules add their tables to it)."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def utcnow() -> datetime:
    """Timezone-aware now in UTC (the only clock the job domain uses for SQL times)."""
    return datetime.now(UTC)


def as_utc(value: datetime) -> datetime:
    """``value`` in UTC; ValueError when it has no offset or leaves the years 1-9999 in UTC
    (``0001-01-01T00:00:00+14:00`` is a valid timestamp but no datetime in UTC)."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError("a timestamp needs a UTC offset (e.g. 'Z' or '+00:00')")
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("the timestamp is out of range once converted to UTC") from None


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always timezone-aware UTC in Python, on PostgreSQL and on SQLite.

    SQLite drops the offset; without this, comparisons between stored and fresh times would mix
    naive and aware datetimes.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# JSON text on every backend (PostgreSQL's ``json``, not ``jsonb``): a document comes back with the
# key order it was sent in, which is meaning for a schema's properties and a tool's parameters
# (migrations/versions/0016_json_keeps_key_order.py says why; no query reads inside these columns).
JSONType = JSON()


class JobStatus(enum.StrEnum):
    """Lifecycle: queued -> running -> succeeded | failed | cancelled; finished -> expired."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_final(self) -> bool:
        return self not in (JobStatus.QUEUED, JobStatus.RUNNING)


FINAL_STATUSES: tuple[JobStatus, ...] = tuple(s for s in JobStatus if s.is_final)


class JobKind(enum.StrEnum):
    """What a job asks for."""

    GENERATE = "generate"
    DECIDE = "decide"
    EXTRACT = "extract"  # a document + a JSON Schema -> a value valid against it (issue 24)


# The predicates of the purge tick's partial indexes: a purge is scheduled; a job whose purge is
# not scheduled yet although it will need one (it has a retention, or it expired).
PURGE_DUE_SQL = "purge_at IS NOT NULL"
PURGE_PENDING_SQL = ("purged_at IS NULL AND purge_at IS NULL"
                     " AND (retention_seconds IS NOT NULL OR status = 'expired')")
# The predicate of the canary's partial index (0015_routed_version_index): only pinned jobs. Every
# query on ``routed_version = ...`` / ``IN (...)`` implies it, so both backends use the index.
ROUTED_SQL = "routed_version IS NOT NULL"


class Job(Base):
    """One asynchronous request and everything known about it."""

    __tablename__ = "jobs"

    id: Mapped[uuid.UUID] = mapped_column(Uuid(as_uuid=True), primary_key=True, default=uuid.uuid4)
    tenant: Mapped[str] = mapped_column(String(128), nullable=False)
    kind: Mapped[str] = mapped_column(String(16), nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False, default=JobStatus.QUEUED.value)
    priority: Mapped[str] = mapped_column(String(16), nullable=False)  # class chosen at submit
    queue: Mapped[str] = mapped_column(String(16), nullable=False)  # current queue (aging moves it)
    cost: Mapped[int] = mapped_column(Integer, nullable=False, default=0)  # tokens x steps estimate

    input: Mapped[dict[str, Any]] = mapped_column(JSONType, nullable=True)
    params: Mapped[dict[str, Any]] = mapped_column(JSONType, nullable=False, default=dict)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONType, nullable=True)

    step_budget: Mapped[int | None] = mapped_column(Integer, nullable=True)
    steps_used: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)

    attempt: Mapped[int] = mapped_column(Integer, nullable=False, default=0)  # claims so far
    max_attempts: Mapped[int] = mapped_column(Integer, nullable=False, default=3)
    lease_deadline: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    worker_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    model_version: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # The version a canary pinned the job to at submit (scheduler/model_versions/canary_routing.py);
    # only a worker serving it may claim the job. None: no canary, any version.
    routed_version: Mapped[str | None] = mapped_column(String(128), nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)

    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    request_fingerprint: Mapped[str | None] = mapped_column(String(64), nullable=True)
    request_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # The OpenTelemetry trace of the submit (scheduler/observability/tracing.py; NULL: not traced):
    # its id is returned in the job's JSON, and the submit span is the parent of every attempt.
    trace_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    trace_span_id: Mapped[str | None] = mapped_column(String(16), nullable=True)
    webhook_url: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The events the webhook wants, space-separated (scheduler/webhooks/events.py); NULL: default.
    webhook_events: Mapped[str | None] = mapped_column(String(128), nullable=True)
    batch_id: Mapped[uuid.UUID | None] = mapped_column(Uuid(as_uuid=True), nullable=True)

    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    available_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    # A delayed job's due time (scheduler/jobs/schedule.py); NULL: published at submit.
    scheduled_for: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    # Data retention (scheduler/access/retention.py, scheduler/maintenance/retention_tick.py): seconds
    # after finishing that the input and output are kept (NULL: until expiry); when the beat's purge
    # tick is due to (re)purge them (NULL: nothing scheduled); when they were purged (the tombstone).
    retention_seconds: Mapped[int | None] = mapped_column(Integer, nullable=True)
    purge_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    purged_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    __table_args__ = (
        UniqueConstraint("tenant", "idempotency_key", name="uq_jobs_tenant_idempotency_key"),
        Index("ix_jobs_tenant_created", "tenant", "created_at", "id"),
        Index("ix_jobs_tenant_status_created", "tenant", "status", "created_at"),
        Index("ix_jobs_status_available", "status", "available_at"),
        Index("ix_jobs_status_scheduled", "status", "scheduled_for"),
        Index("ix_jobs_status_lease", "status", "lease_deadline"),
        Index("ix_jobs_status_expires", "status", "expires_at"),
        Index("ix_jobs_batch", "batch_id"),
        # Partial: only the rows the purge tick looks for (its queries repeat the predicates).
        Index("ix_jobs_purge_due", "purge_at", postgresql_where=text(PURGE_DUE_SQL),
              sqlite_where=text(PURGE_DUE_SQL)),
        Index("ix_jobs_purge_pending", "finished_at", postgresql_where=text(PURGE_PENDING_SQL),
              sqlite_where=text(PURGE_PENDING_SQL)),
        # The canary gate's tally (scheduler/model_versions/canary_gate.py) and the pin healing:
        # pinned jobs only, so unpinned traffic (the usual case) never pays for it.
        Index("ix_jobs_routed_version", "routed_version", "status", "created_at",
              postgresql_where=text(ROUTED_SQL), sqlite_where=text(ROUTED_SQL)),
    )

    @property
    def job_status(self) -> JobStatus:
        return JobStatus(self.status)

    def __repr__(self) -> str:
        return f"<Job {self.id} {self.kind} {self.status} attempt={self.attempt}>"
