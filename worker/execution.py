"""Turning a job row into engine requests and an engine result into a job outcome (pure logic).

No Celery, no SQL here: ``worker/job_runner.py`` claims, runs and records the outcome. Kinds
are dispatched through ``KIND_HANDLERS``: ``generate`` here, ``decide`` in ``worker/decide_job.py``,
``extract`` in ``worker/extract_job.py`` (a schema's canvas, as ``response_schema`` here, through
``worker/structured_job.py``).
What a handler receives and returns (``JobSpec``, ``EngineContext``, ``Outcome``) and the mapping
both kinds share live in ``worker/job_handler.py``, below both, so ``decide_job`` does not import
this module; import those names from there (this module re-exports nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from scheduler.jobs.models import JobKind
from scheduler.jobs.retry import InputJobError
from worker.decide_job import run_decide
from worker.engine.types import GenerationRequest
from worker.extract_job import run_extract
from worker.job_handler import (
    ChatTokenizer,
    EngineContext,
    JobSpec,
    Outcome,
    outcome_of,
    planned_blocks,
    sampling_params,
)
from worker.structured.tool_render import template_messages
from worker.structured_job import run_structured
from worker.thinking import thinking_fields
from worker.tool_job import job_tool_spec, run_with_tools


def prompt_ids(input: Mapping[str, Any], params: Mapping[str, Any], tokenizer: ChatTokenizer) -> list[int]:
    """Token ids of the prompt: raw ``prompt`` text, or chat ``messages`` through the chat template."""
    if input.get("messages") is not None:
        thinking = bool(params.get("thinking", False))
        # tools reach the template as Hugging Face passes them (none: not rendered, not parsed)
        tools = input.get("tools") if input.get("tool_choice") != "none" else None
        kwargs: dict[str, Any] = {"tools": list(tools)} if tools else {}
        try:
            text = tokenizer.render_chat(template_messages(input["messages"]), enable_thinking=thinking,
                                         **kwargs)
        except Exception as exc:  # a template error is the caller's input problem, not a fault
            raise InputJobError(f"messages cannot be rendered: {exc}") from exc
        return tokenizer.encode(text)
    if input.get("prompt") is not None:
        return tokenizer.encode(str(input["prompt"]))
    raise InputJobError("input needs 'prompt' or 'messages'")


def thinking_render(tokenizer: ChatTokenizer) -> Callable[[list[int]], tuple[str, str | None]]:
    """Committed ids of a thinking-mode job -> (answer so far, reasoning so far), split as the
    result will be (``worker/thinking.py``)."""

    def render(ids: list[int]) -> tuple[str, str | None]:
        fields = thinking_fields(ids, tokenizer)  # type: ignore[arg-type]
        if fields.get("reasoning") is None:  # no thinking markers in this checkpoint
            return tokenizer.decode(ids, skip_special_tokens=True), None
        return str(fields["text"]), str(fields["reasoning"])

    return render


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
            prompt_tokens=len(request.prompt_ids),
        )
    schema = job.input.get("response_schema")
    if schema is not None:
        return run_structured(request, schema, ctx, field="response_schema")
    if job.input.get("tools") and job.input.get("tool_choice") != "none":
        spec = job_tool_spec(job, ctx)
        if spec is not None:
            return run_with_tools(request, spec, job, ctx)
    outcome = outcome_of(ctx.submit(request).result(), ctx.tokenizer)
    if job.params.get("thinking") and outcome.result is not None:
        outcome.result.update(thinking_fields(outcome.result["token_ids"], ctx.tokenizer))  # type: ignore[arg-type]
    return outcome


KIND_HANDLERS: dict[str, Callable[[JobSpec, EngineContext], Outcome]] = {
    JobKind.GENERATE.value: run_generate,
    JobKind.DECIDE.value: run_decide,
    JobKind.EXTRACT.value: run_extract,
}


def run_kind(job: JobSpec, ctx: EngineContext) -> Outcome:
    handler = KIND_HANDLERS.get(job.kind)
    if handler is None:
        raise InputJobError(f"this worker does not serve jobs of kind {job.kind!r}")
    return handler(job, ctx)
