"""Batch requests and responses (``/v1/batches``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, HttpUrl

from api.schemas.common import Metadata
from api.schemas.jobs import JobCreate


class BatchOptions(BaseModel):
    """What a batch carries besides its jobs (query or form fields for JSONL uploads)."""

    model_config = ConfigDict(extra="forbid")

    webhook_url: HttpUrl | None = Field(None, description="POSTed (signed) once every job is final.")
    metadata: Metadata | None = None


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
