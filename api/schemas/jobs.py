"""Job requests and responses.

The create body is a discriminated union on ``kind`` (:data:`JobCreate`): a new kind (the
decision jobs) adds one model to the union and nothing else changes. All request models
forbid unknown fields so typos fail loudly instead of being silently ignored. Numeric limits
that depend on the deployment (``max_new_tokens`` etc.) are checked against ``Settings`` in
:mod:`api.limits`; the static bounds here only reject values that are never meaningful.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, HttpUrl, model_validator

from api.schemas.common import (
    MAX_BLOCK_SIZE,
    MAX_NEW_TOKENS_BOUND,
    MAX_SEED,
    MAX_STEP_BUDGET_BOUND,
    MAX_STEPS_PER_BLOCK_BOUND,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    Metadata,
    Text,
)
from api.schemas.decisions import DecideInput, DecideParams
from scheduler.queue_names import PRIORITY_CLASSES
from scheduler.routing import PRIORITY_ALIASES

MAX_MESSAGES = 256


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChatMessage(_Strict):
    """One chat turn; the worker renders the checkpoint's chat template."""

    role: Literal["system", "user", "assistant"]
    content: Text


class GenerateInput(_Strict):
    """What to continue: a raw ``prompt`` or chat ``messages`` (exactly one of them)."""

    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> GenerateInput:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self

    def text_parts(self) -> list[str]:
        """Every piece of user-supplied text (for size and token-count limits)."""
        if self.prompt is not None:
            return [self.prompt]
        return [message.content for message in self.messages or ()]


class GenerateParams(_Strict):
    """Decoding parameters (see the decoding contract, docs/architecture.md §3.7); ``None`` = default."""

    max_new_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_BOUND,
                                       description="Default: settings.limits.default_max_new_tokens.")
    block_size: int | None = Field(None, ge=1, le=MAX_BLOCK_SIZE,
                                   description="Default: the checkpoint's block size.")
    steps_per_block: int | None = Field(
        None, ge=1, le=MAX_STEPS_PER_BLOCK_BOUND,
        description="Default: settings.limits.default_steps_per_block, else the model family's "
        "(Clover, LLaDA2: the block size; SDAR: 4).",
    )
    strategy: Literal["static", "dynamic"] | None = Field(
        None, description="Default: the model family's (Clover, LLaDA2: dynamic; SDAR: static)."
    )
    threshold: float | None = Field(
        None, gt=0.0, le=1.0,
        description="Confidence threshold (dynamic strategy). Default: the family's (0.95; SDAR 0.9).",
    )
    temperature: float = Field(0.0, ge=0.0, le=MAX_TEMPERATURE, description="0 = greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    step_budget: int | None = Field(None, ge=1, le=MAX_STEP_BUDGET_BOUND,
                                    description="Max denoising passes for the whole job.")
    thinking: bool | None = Field(
        None, description="enable_thinking for the chat template; default settings.thinking.default."
    )
    fault: Text | None = Field(None, description="Test-only fault injection; rejected unless enabled.")


# Classes a client may ask for, plus the aliases high/normal/low: derived from
# scheduler.queue_names.PRIORITY_CLASSES and scheduler.routing.PRIORITY_ALIASES.
PRIORITY_NAMES: tuple[str, ...] = (*(q.value for q in PRIORITY_CLASSES), *PRIORITY_ALIASES)
if TYPE_CHECKING:
    Priority = str
else:
    Priority = Literal[PRIORITY_NAMES]  # a Literal of every name (the OpenAPI enum)


class _JobCreateBase(_Strict):
    priority: Priority | None = Field(
        None, description="Requested class; may only lower the class the cost estimate gives."
    )
    metadata: Metadata | None = Field(
        None, description="Your labels (echoed in reads and webhooks); at most "
        "settings.limits.max_metadata_bytes as compact JSON.",
    )
    webhook_url: HttpUrl | None = Field(
        None, description="POSTed (signed) when the job is final; no credentials, and only public "
        "addresses unless settings.webhooks.allowed_hosts / webhook_allowed_networks name it.",
    )


class GenerateJobCreate(_JobCreateBase):
    """Create a text generation job."""

    kind: Literal["generate"]
    input: GenerateInput
    params: GenerateParams = Field(default_factory=GenerateParams)


class DecideJobCreate(_JobCreateBase):
    """Create a decision job: multiple-choice answers about a document, always valid JSON."""

    kind: Literal["decide"]
    input: DecideInput
    params: DecideParams = Field(default_factory=DecideParams)


# Add new kinds here; the discriminator picks the model by ``kind``.
JobCreate = Annotated[GenerateJobCreate | DecideJobCreate, Field(discriminator="kind")]


class JobProgress(BaseModel):
    """Live progress of a running job (from the Redis hot status when available)."""

    blocks_done: int | None = None
    blocks_total: int | None = None
    steps_used: int | None = None
    step_budget: int | None = None
    tokens_committed: int | None = None
    partial_text: str | None = None


class JobResult(BaseModel):
    """The outcome of a succeeded job."""

    text: str | None = None
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    reasoning: str | None = Field(None, description="generate with thinking: the text inside <think>.")
    mode: str | None = Field(None, description="decide: independent | joint.")
    answers: list[dict[str, Any]] | None = Field(
        None, description='decide: [{"id", "choice", "confidence", "rationale"?}] in question order.'
    )


class JobErrorInfo(BaseModel):
    """Why a job failed."""

    code: str | None = None
    message: str | None = None


class JobTimings(BaseModel):
    """Timestamps plus the derived durations in milliseconds."""

    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    expires_at: datetime | None = None
    queued_ms: float | None = None
    run_ms: float | None = None
    total_ms: float | None = None
    engine_queue_ms: float | None = None
    engine_run_ms: float | None = None


class JobOut(BaseModel):
    """A job as clients see it."""

    id: str
    kind: str
    status: str
    queue: str | None = None
    priority: str | None = None
    tenant: str | None = None
    attempt: int = 0
    max_attempts: int | None = None
    model_version: str | None = None
    routed_version: str | None = Field(
        None, description="The version a canary pinned the job to (only a worker serving it runs the job).")
    params: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    progress: JobProgress | None = None
    result: JobResult | None = None
    error: JobErrorInfo | None = None
    timings: JobTimings
    cancel_requested: bool = False


class JobList(BaseModel):
    """One page of jobs; pass ``next_cursor`` back as ``cursor`` for the next page."""

    items: list[JobOut]
    next_cursor: str | None = None
