"""Turning a job row into engine requests and an engine result into a job outcome (pure logic).

No Celery, no SQL here: ``worker.runtime`` does the claiming, waiting and writing. Kinds are
dispatched through ``KIND_HANDLERS`` (``generate`` here; ``decide`` is added by the decision
service).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from scheduler.models import ErrorCode, JobKind, JobStatus
from scheduler.retry import InputJobError
from scheduler.settings import Settings
from worker.engine.types import FinishReason, GenerationRequest, GenerationResult, Progress, SamplingParams
from worker.thinking import thinking_fields

SAMPLING_KEYS: tuple[str, ...] = (
    "max_new_tokens", "block_size", "steps_per_block", "strategy", "threshold", "temperature",
    "top_k", "top_p", "seed", "step_budget",
)


class ChatTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def render_chat(self, messages: list[dict[str, Any]], *, enable_thinking: bool,
                    add_generation_prompt: bool = True) -> str: ...


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


def prompt_ids(input: Mapping[str, Any], params: Mapping[str, Any], tokenizer: ChatTokenizer) -> list[int]:
    """Token ids of the prompt: raw ``prompt`` text, or chat ``messages`` through the chat template."""
    if input.get("messages") is not None:
        thinking = bool(params.get("thinking", False))
        try:
            text = tokenizer.render_chat(list(input["messages"]), enable_thinking=thinking)
        except Exception as exc:  # a template error is the caller's input problem, not a fault
            raise InputJobError(f"messages cannot be rendered: {exc}") from exc
        return tokenizer.encode(text)
    if input.get("prompt") is not None:
        return tokenizer.encode(str(input["prompt"]))
    raise InputJobError("input needs 'prompt' or 'messages'")


def planned_blocks(prompt_len: int, max_new_tokens: int, block_size: int | None) -> int | None:
    """Blocks a plain request decodes at most: from the prompt's last (partial) block to the block
    holding its last generated position (``worker/sampler/layout.py`` ``build_layout``); fewer when
    it stops at EOS or on its budget."""
    if not block_size or block_size < 1 or max_new_tokens < 1:
        return None
    return -(-(prompt_len + max_new_tokens) // block_size) - prompt_len // block_size


def thinking_render(tokenizer: ChatTokenizer) -> Callable[[list[int]], tuple[str, str | None]]:
    """Committed ids of a thinking-mode job -> (answer so far, reasoning so far), split as the
    result will be (``worker/thinking.py``)."""

    def render(ids: list[int]) -> tuple[str, str | None]:
        fields = thinking_fields(ids, tokenizer)  # type: ignore[arg-type]
        if fields.get("reasoning") is None:  # no thinking markers in this checkpoint
            return tokenizer.decode(ids, skip_special_tokens=True), None
        return str(fields["text"]), str(fields["reasoning"])

    return render


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


def run_generate(job: JobSpec, ctx: EngineContext) -> Outcome:
    """A ``generate`` job: one sequence through the engine. Engine exceptions propagate (transient)."""
    request = GenerationRequest(
        request_id=job.job_id,
        prompt_ids=prompt_ids(job.input, job.params, ctx.tokenizer),
        params=sampling_params(job.params, ctx.settings),
        slot_class=job.queue,
        deadline=ctx.deadline,
        on_progress=ctx.on_progress,
        cancel_event=ctx.cancel_event,
    )
    if ctx.on_plan is not None:
        ctx.on_plan(
            blocks_total=planned_blocks(len(request.prompt_ids), request.params.max_new_tokens,
                                        request.params.block_size or ctx.default_block_size),
            render=thinking_render(ctx.tokenizer) if job.params.get("thinking") else None,
        )
    outcome = outcome_of(ctx.submit(request).result(), ctx.tokenizer)
    if job.params.get("thinking") and outcome.result is not None:
        outcome.result.update(thinking_fields(outcome.result["token_ids"], ctx.tokenizer))  # type: ignore[arg-type]
    return outcome


def run_decide(job: JobSpec, ctx: EngineContext) -> Outcome:
    """A ``decide`` job (``worker.decide_job``; imported here lazily: it builds on this module)."""
    from worker.decide_job import run_decide as run

    return run(job, ctx)


KIND_HANDLERS: dict[str, Callable[[JobSpec, EngineContext], Outcome]] = {
    JobKind.GENERATE.value: run_generate,
    JobKind.DECIDE.value: run_decide,
}


def run_kind(job: JobSpec, ctx: EngineContext) -> Outcome:
    handler = KIND_HANDLERS.get(job.kind)
    if handler is None:
        raise InputJobError(f"this worker does not serve jobs of kind {job.kind!r}")
    return handler(job, ctx)
