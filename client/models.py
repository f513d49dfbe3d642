"""Typed views of what the cloverq API answers (pydantic; unknown fields are kept, not refused,
so a newer server never breaks an older client)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

FINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled", "expired"})


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class JobProgress(_Model):
    """Blocks, steps and tokens of a job (live while it runs, its final figures once it ends).

    ``prompt_tokens_done`` of ``prompt_tokens``: the prompt's prefill (0 of N while the first
    pass prefills a long prompt, before any block; N after)."""

    blocks_done: int | None = None
    blocks_total: int | None = None
    steps_used: int | None = None
    step_budget: int | None = None
    tokens_committed: int | None = None
    prompt_tokens: int | None = None
    prompt_tokens_done: int | None = None
    partial_text: str | None = None

    @property
    def prefilling(self) -> bool:
        """Whether the prompt is still being prefilled (no block committed yet)."""
        return (self.prompt_tokens is not None and (self.prompt_tokens_done or 0) < self.prompt_tokens
                and not self.blocks_done)


class JobResult(_Model):
    """The outcome: ``text`` (and ``reasoning`` in thinking mode), decision ``answers``, or for
    ``extract`` (and ``generate`` with a ``response_schema``) ``data``, the value valid against
    the schema (``text`` is its JSON), with ``confidence`` per choice field by JSON pointer."""

    text: str | None = None
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    reasoning: str | None = None
    mode: str | None = None
    answers: list[dict[str, Any]] | None = None
    data: Any = None
    confidence: dict[str, float] | None = None
    tool_calls: list[dict[str, Any]] | None = None


class JobError(_Model):
    code: str | None = None
    message: str | None = None


class JobTimings(_Model):
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    expires_at: datetime | None = None
    queued_ms: float | None = None
    run_ms: float | None = None
    total_ms: float | None = None


class Job(_Model):
    """A job as ``GET /v1/jobs/{id}`` shows it."""

    id: str
    kind: str
    status: str
    queue: str | None = None
    priority: str | None = None
    tenant: str | None = None
    attempt: int = 0
    max_attempts: int | None = None
    model_version: str | None = None
    routed_version: str | None = None  # pinned by a canary at submit (None: any version)
    params: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    progress: JobProgress | None = None
    result: JobResult | None = None
    error: JobError | None = None
    timings: JobTimings = Field(default_factory=JobTimings)
    cancel_requested: bool = False

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATUSES

    @property
    def text(self) -> str | None:
        return self.result.text if self.result else None

    @property
    def data(self) -> Any:
        """An extract job's value (``result.data``); None until it succeeded."""
        return self.result.data if self.result else None


class JobPage(_Model):
    items: list[Job]
    next_cursor: str | None = None


class Batch(_Model):
    """A cloverq batch (``/v1/batches``) and its job counts by status."""

    id: str
    status: str
    total: int
    finished: int
    counts: dict[str, int] = Field(default_factory=dict)
    created_at: datetime | None = None
    cancel_requested: bool = False
    webhook_url: str | None = None
    metadata: dict[str, Any] | None = None
    results_url: str | None = None

    @property
    def is_final(self) -> bool:
        return self.status in ("completed", "cancelled")


class JobEvent(_Model):
    """One event of ``GET /v1/jobs/{id}/events``: ``status``, ``progress``, ``delta`` or
    ``result`` (``data`` as sent; ``job`` set for ``result``, ``text`` for ``delta``)."""

    event: str
    data: dict[str, Any] = Field(default_factory=dict)
    id: str | None = None

    @property
    def job(self) -> Job | None:
        return Job.model_validate(self.data) if self.event == "result" else None

    @property
    def text(self) -> str:
        return str(self.data.get("text") or "") if self.event == "delta" else ""
