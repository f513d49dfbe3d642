"""Batch requests and responses (``/v1/batches``)."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, Field, HttpUrl, field_validator, model_validator

from api.schemas.common import MAX_RETENTION_SECONDS, Metadata, StrictModel, UtcDateTime
from api.schemas.jobs import JobCreate
from scheduler.webhooks.events import ORDER

if TYPE_CHECKING:
    BatchWebhookEvent = str
else:  # every filter (scheduler/webhooks/events.py), batch_completed included
    BatchWebhookEvent = Literal[tuple(event.value for event in ORDER)]


class BatchOptions(StrictModel):
    """What a batch carries besides its jobs (query or form fields for JSONL uploads)."""

    webhook_url: HttpUrl | None = Field(None, description="POSTed (signed) once every job is final.")
    metadata: Metadata | None = None
    retention_seconds: int | None = Field(
        None, ge=0, le=MAX_RETENTION_SECONDS,
        description="Data retention of the batch's jobs that set none (seconds after each finishes; "
        "docs/security.md#retention). Default: the tenant's; above its maximum: 422 retention_too_long.",
    )
    not_before: UtcDateTime | None = Field(
        None, description="No job of the batch starts before this (with a UTC offset); its jobs stay "
        "queued with scheduled_for until then. Bounds as for a job's not_before (422 invalid_schedule).",
    )
    delay_seconds: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="Instead of not_before: this many seconds from now.")
    webhook_events: Annotated[list[BatchWebhookEvent], Field(min_length=1)] | None = Field(
        None, description="The events the batch's webhook wants (needs webhook_url; a query or form "
        "field: comma-separated): batch_completed (batch.finished), and any job event (started, progress, "
        "succeeded, failed, cancelled), sent for each job without a webhook_url of its own. Default: "
        "batch.finished only.",
    )

    @field_validator("webhook_events", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        """A query or form field carries the list as comma-separated text."""
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _events_need_url(self) -> BatchOptions:
        if self.webhook_events is not None and self.webhook_url is None:
            raise ValueError("webhook_events needs a webhook_url")
        return self


class BatchCreate(BatchOptions):
    """A JSON batch: job specs in submission order (each exactly a ``POST /v1/jobs`` body).

    The same specs may instead be uploaded as JSONL (one spec per line), either as the raw body
    (``Content-Type: application/x-ndjson``) or as a multipart ``file`` field; then
    ``webhook_url`` / ``metadata`` come as query or form fields.
    """

    jobs: Annotated[list[JobCreate], Field(min_length=1)]


class BatchOut(BaseModel):
    """A batch and its job counts by status."""

    id: str
    status: str = Field(description="running | cancelling | completed | cancelled")
    total: int
    finished: int
    counts: dict[str, int]
    created_at: datetime
    cancel_requested: bool
    webhook_url: str | None = None
    metadata: dict[str, Any] | None = None
    results_url: str
    retention_seconds: int | None = Field(None, description="The retention its jobs got when they set none.")
    purged_at: datetime | None = Field(
        None, description="When every job's data was purged at the tenant's request (DELETE .../data).")
    scheduled_for: datetime | None = Field(None, description="A delayed batch's start (not_before / delay).")
    webhook_events: list[str] | None = Field(None, description="Its webhook's events; null: the default.")
