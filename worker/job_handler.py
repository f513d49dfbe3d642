"""What a job kind's handler receives and returns, and the request mapping every kind shares.

A handler is ``(JobSpec, EngineContext) -> Outcome`` (``worker.execution.KIND_HANDLERS``):
``generate`` in ``worker/execution.py``, ``decide`` in ``worker/decide_job.py``. Both build on the
pieces here, which is why they live in neither: with them in ``execution``, ``decide_job``
imported ``execution`` and ``execution`` could reach ``decide_job`` only by a function-level import
(an import cycle). No Celery, no SQL.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from scheduler.infra.settings import Settings
from scheduler.jobs.models import ErrorCode, JobStatus
from scheduler.jobs.retry import InputJobError
from worker.engine.types import FinishReason, GenerationRequest, GenerationResult, Progress, SamplingParams

SAMPLING_KEYS: tuple[str, ...] = (
    "max_new_tokens", "block_size", "steps_per_block", "strategy", "threshold", "temperature",
    "top_k", "top_p", "seed", "step_budget",
)


class ChatTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def render_chat(self, messages: list[dict[str, Any]], *, enable_thinking: bool,
                    add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None) -> str: ...


@dataclass(frozen=True)
class JobSpec:
    """What a handler needs from the job row (a plain copy: no ORM object crosses threads)."""

    job_id: str
    kind: str
    queue: str
    attempt: int
    input: Mapping[str, Any]
    params: Mapping[str, Any]


@dataclass
class EngineContext:
    """What a handler may use: the engine's submit, the tokenizer, request plumbing."""

    submit: Callable[[GenerationRequest], Future[GenerationResult]]
    tokenizer: ChatTokenizer
    settings: Settings
    deadline: float | None  # time.monotonic() deadline of this attempt
    cancel_event: Any  # threading.Event shared by every request of the job
    on_progress: Callable[[Progress], None]
    # Told before the engine runs: ``blocks_total`` (planned blocks) and ``render`` (committed
    # ids -> (answer, reasoning or None)) for the progress and the event stream (worker/monitor.py).
    on_plan: Callable[..., None] | None = None
    default_block_size: int | None = None  # the checkpoint's (used when params give none)
    joint_decode: str | None = None  # the checkpoint's generation_config.json ``joint_decode``
    # queues several requests in one admission round (Engine.submit_many: shared prompt prefixes)
    submit_many: Callable[[Sequence[GenerationRequest]], list[Future[GenerationResult]]] | None = None


@dataclass
class Outcome:
    """What the runtime writes back for one attempt."""

    status: JobStatus
    result: dict[str, Any] | None = None
    steps_used: int = 0
    error_code: str | None = None
    error_message: str | None = None
    finish_reason: str | None = None
    tokens: int = 0
    prompt_tokens: int = 0


def sampling_params(params: Mapping[str, Any], settings: Settings) -> SamplingParams:
    """Job params -> engine params, with the deployment's defaults filled in."""
    values = {k: params[k] for k in SAMPLING_KEYS if params.get(k) is not None}
    values.setdefault("max_new_tokens", settings.limits.default_max_new_tokens)
    if settings.limits.default_steps_per_block is not None:  # else the engine's family default
        values.setdefault("steps_per_block", settings.limits.default_steps_per_block)
    try:
        return SamplingParams(**values)
    except TypeError as exc:
        raise InputJobError(f"invalid params: {exc}") from exc


def planned_blocks(prompt_len: int, max_new_tokens: int, block_size: int | None) -> int | None:
    """Blocks a plain request decodes at most: from the prompt's last (partial) block to the block
    holding its last generated position (``worker/sampler/layout.py`` ``build_layout``); fewer when
    it stops at EOS or on its budget."""
    if not block_size or block_size < 1 or max_new_tokens < 1:
        return None
    return -(-(prompt_len + max_new_tokens) // block_size) - prompt_len // block_size


def complete_answer(outcome: Outcome, result: GenerationResult) -> None:
    """The outcome of a canvas read back: decoded to its end (the engine says ``length``: it
    decoded the template's last token), it is a complete answer, not a cut one, so the job says
    ``eos``, as a decision job whose answers were all read does. Clients read ``length`` as
    truncated: OpenAI's own SDK refuses to parse structured output whose ``finish_reason`` is
    ``length`` (``LengthFinishReasonError``), so every ``chat.completions.parse`` call failed. A step
    budget that ran out keeps ``budget``."""
    if result.finish_reason is not FinishReason.LENGTH:
        return
    outcome.finish_reason = FinishReason.EOS.value
    if outcome.result is not None:
        outcome.result["finish_reason"] = FinishReason.EOS.value


def outcome_of(result: GenerationResult, tokenizer: ChatTokenizer) -> Outcome:
    """Map one engine result to a job outcome (cancellation is decided by the caller)."""
    usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.tokens,
             "steps_used": result.steps_used, "blocks": result.blocks}
    body = {
        "text": tokenizer.decode(result.token_ids, skip_special_tokens=True),
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason.value,
        "usage": usage,
        "timings": {"engine_queue_seconds": result.queue_seconds, "engine_run_seconds": result.run_seconds},
    }
    common: dict[str, Any] = {"steps_used": result.steps_used, "finish_reason": result.finish_reason.value,
              "tokens": result.tokens, "prompt_tokens": result.prompt_tokens}
    if result.finish_reason is FinishReason.ERROR:
        return Outcome(JobStatus.FAILED, None, error_code=ErrorCode.INVALID_INPUT.value,
                       error_message=result.error or "invalid request", **common)
    if result.finish_reason is FinishReason.CANCELLED:
        return Outcome(JobStatus.CANCELLED, body, **common)
    if result.finish_reason is FinishReason.DEADLINE:
        return Outcome(JobStatus.FAILED, body, error_code=ErrorCode.DEADLINE_EXCEEDED.value,
                       error_message="the attempt ran past its deadline", **common)
    return Outcome(JobStatus.SUCCEEDED, body, **common)
