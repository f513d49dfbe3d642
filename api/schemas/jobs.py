"""Job requests and responses.

The create body is a discriminated union on ``kind`` (:data:`JobCreate`): a new kind (the
decision jobs) adds one model to the union and nothing else changes. All request models
forbid unknown fields so typos fail loudly instead of being silently ignored. Numeric limits
that depend on the deployment (``max_new_tokens`` etc.) are checked against ``Settings`` in
:mod:`api.limits`; the static bounds here only reject values that are never meaningful.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, Field, HttpUrl, model_validator

from api.schemas.common import (
    MAX_NEW_TOKENS_BOUND,
    MAX_RETENTION_SECONDS,
    Metadata,
    StrictModel,
    Text,
    UtcDateTime,
)
from api.schemas.decisions import DecideInput, DecideParams
from api.schemas.decoding import DecodingParams
from api.schemas.extract import ExtractInput, ExtractParams
from scheduler.infra.queue_names import PRIORITY_CLASSES
from scheduler.jobs.routing import PRIORITY_ALIASES
from scheduler.webhooks.events import JOB_FILTERS

MAX_MESSAGES = 256
MAX_TOOL_CALLS = 128  # calls of one assistant turn


class ToolCallFunction(StrictModel):
    name: Text
    arguments: Text = Field(description="The call's arguments: a JSON object, as text (OpenAI's shape).")


class ToolCall(StrictModel):
    """A call an earlier assistant turn made (rendered back through the chat template)."""

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(StrictModel):
    """One chat turn; the worker renders the checkpoint's chat template. ``tool_calls`` only on
    an assistant turn, ``tool_call_id`` only on a ``tool`` turn (a tool's result)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: Text
    tool_calls: Annotated[list[ToolCall], Field(min_length=1, max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: Text | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message carries 'tool_calls'")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only a tool message carries 'tool_call_id'")
        for call in self.tool_calls or ():
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise ValueError(f"tool call {call.id!r}: 'arguments' must be a JSON object as text")
        return self


class GenerateInput(StrictModel):
    """What to continue: a raw ``prompt`` or chat ``messages`` (exactly one of them)."""

    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    response_schema: dict[str, Any] | None = Field(
        None, description="A JSON Schema (the subset in docs/structured.md): the result's text is the "
        "JSON of a value valid against it by construction, data the value. Outside the subset or over "
        "settings.limits.max_schema_bytes / max_schema_depth: 400 invalid_schema, "
        "unsupported_schema_keyword or schema_too_large, nothing stored.",
    )
    tools: list[Any] | None = Field(
        None, description="Functions the model may call, OpenAI's shape ({\"type\": \"function\", "
        "\"function\": {\"name\", \"description\", \"parameters\"}}), rendered by the chat template "
        "(messages only). At most settings.limits.max_tools; parameters inside the schema subset "
        "(docs/structured.md#tools). The result's tool_calls holds the calls parsed from the output.",
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="none, auto (default with tools), required, or {\"type\": \"function\", "
        "\"function\": {\"name\": ...}}; named and required calls are valid by construction.",
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call is returned.")

    @model_validator(mode="after")
    def _exactly_one(self) -> GenerateInput:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.prompt is not None and (self.tools or self.tool_choice not in (None, "none")):
            raise ValueError("tools need chat 'messages' (the chat template renders them)")
        if self.response_schema is not None and self.tools and self.tool_choice != "none":
            raise ValueError("give 'response_schema' or 'tools', not both")
        return self

    def text_parts(self) -> list[str]:
        """Every piece of user-supplied text (for size and token-count limits)."""
        if self.prompt is not None:
            return [self.prompt]
        parts = [message.content for message in self.messages or ()]
        parts += [call.function.name + call.function.arguments for message in self.messages or ()
                  for call in message.tool_calls or ()]
        if self.tools and self.tool_choice != "none":  # rendered into the prompt by the template
            parts.append(json.dumps(self.tools, ensure_ascii=False))
        return parts


class GenerateParams(DecodingParams):
    """A generate job's decoding parameters: the shared ones, its length and thinking mode."""

    max_new_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_BOUND,
                                       description="Default: settings.limits.default_max_new_tokens.")
    thinking: bool | None = Field(
        None, description="enable_thinking for the chat template; default settings.thinking.default."
    )


# Classes a client may ask for, plus the aliases high/normal/low: derived from
# scheduler.infra.queue_names.PRIORITY_CLASSES and scheduler.jobs.routing.PRIORITY_ALIASES.
PRIORITY_NAMES: tuple[str, ...] = (*(q.value for q in PRIORITY_CLASSES), *PRIORITY_ALIASES)
if TYPE_CHECKING:
    Priority = str
else:
    Priority = Literal[PRIORITY_NAMES]  # a Literal of every name (the OpenAPI enum)


# The webhook events a job may name (scheduler/webhooks/events.py; a batch adds batch_completed).
JOB_WEBHOOK_EVENTS: tuple[str, ...] = tuple(event.value for event in JOB_FILTERS)
if TYPE_CHECKING:
    JobWebhookEvent = str
else:
    JobWebhookEvent = Literal[JOB_WEBHOOK_EVENTS]


class _JobCreateBase(StrictModel):
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
    webhook_events: Annotated[list[JobWebhookEvent], Field(min_length=1)] | None = Field(
        None, description="The events the webhook wants (needs webhook_url): started (job.started), "
        "progress (job.progress, at most one per settings.webhooks.progress_interval_seconds), succeeded, "
        "failed, cancelled (job.finished with that status). Default: job.finished on any final status.",
    )
    not_before: UtcDateTime | None = Field(
        None, description="Start no earlier than this (with a UTC offset); the job stays queued with "
        "scheduled_for until then. At most settings.jobs.delay_past_tolerance_seconds in the past and "
        "settings.jobs.delay_max_seconds ahead, else 422 invalid_schedule.",
    )
    delay_seconds: float | None = Field(
        None, ge=0, allow_inf_nan=False,
        description="Start no earlier than this many seconds after submission (instead of not_before).",
    )
    retention_seconds: int | None = Field(
        None, ge=0, le=MAX_RETENTION_SECONDS,
        description="Purge the job's input, output, partial text, stream events and webhook bodies this "
        "many seconds after it finishes (docs/security.md#retention); a tombstone stays. Default: the "
        "tenant's; above the tenant's maximum: 422 retention_too_long.",
    )

    @model_validator(mode="after")
    def _webhook_options(self) -> _JobCreateBase:
        if self.webhook_events is not None and self.webhook_url is None:
            raise ValueError("webhook_events needs a webhook_url")
        return self


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


class ExtractJobCreate(_JobCreateBase):
    """Create an extract job: a value valid against a JSON Schema, read from a document."""

    kind: Literal["extract"]
    input: ExtractInput
    params: ExtractParams = Field(default_factory=ExtractParams)


# Add new kinds here; the discriminator picks the model by ``kind``.
JobCreate = Annotated[GenerateJobCreate | DecideJobCreate | ExtractJobCreate, Field(discriminator="kind")]


class JobProgress(BaseModel):
    """Live progress of a running job (from the Redis hot status when available)."""

    blocks_done: int | None = None
    blocks_total: int | None = None
    steps_used: int | None = None
    step_budget: int | None = None
    tokens_committed: int | None = None
    # Prompt positions to prefill, and how many are done: 0 of N while the first pass prefills
    # (a long prompt takes a while before its first block), N after.
    prompt_tokens: int | None = None
    prompt_tokens_done: int | None = None
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
    data: Any = Field(
        None, description="extract, and generate with a response_schema: the value read from the output, "
        "valid against the schema by construction (text is its JSON).",
    )
    confidence: dict[str, float] | None = Field(
        None, description="extract, and generate with a response_schema: the probability of each choice "
        "field (enum, boolean, small integer range), keyed by JSON pointer ('/' for the whole value).",
    )
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description='generate with tools: the calls read from the output, OpenAI\'s shape '
        '[{"id", "type": "function", "function": {"name", "arguments"}}] (arguments: JSON text); text is '
        "then the content outside the calls.",
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
    trace_id: str | None = Field(
        None, description="The job's OpenTelemetry trace (32 hex digits) when tracing recorded its submit; "
        "null otherwise (tracing off or not sampled).",
    )
    scheduled_for: datetime | None = Field(
        None, description="A delayed job's start (not_before / delay_seconds): it stays queued until then.")
    webhook_events: list[str] | None = Field(
        None, description="The webhook events the job asked for; null: the default (job.finished).")
    retention_seconds: int | None = Field(
        None, description="Seconds after it finishes that the job's data is kept; null: until it expires.")
    purged_at: datetime | None = Field(
        None, description="When the job's input, output, partial text, stream events and webhook bodies "
        "were purged (retention, expiry or DELETE /v1/jobs/{id}/data); then result is null and only "
        "this tombstone (status, timings, usage, metadata) remains. Null while the data is kept.")
    usage: dict[str, Any] | None = Field(
        None, description="The outcome's token and step counts (result.usage); kept when the data is purged.")


class JobList(BaseModel):
    """One page of jobs; pass ``next_cursor`` back as ``cursor`` for the next page."""

    items: list[JobOut]
    next_cursor: str | None = None
