"""The ``extract`` kind for the worker: a document and a JSON Schema -> a value valid against it.

Registered in ``worker.execution.KIND_HANDLERS``. The prompt is ``scheduler.jobs.extract_prompt``
(the document first, so jobs over one document share its prefill in the engine's prefix cache)
rendered through the checkpoint's chat template with thinking off: the canvas is decoded right
after the prompt, where a thinking template would open the reasoning. The canvas and the read-back
are the ones of ``response_schema`` (``worker/structured_job.py``).
"""

from __future__ import annotations

from typing import Any

from scheduler.jobs.extract_prompt import extract_messages
from scheduler.jobs.retry import InputJobError
from worker.engine.types import GenerationRequest
from worker.job_handler import ChatTokenizer, EngineContext, JobSpec, Outcome, sampling_params
from worker.structured_job import run_structured


def extract_prompt_ids(job: JobSpec, tokenizer: ChatTokenizer) -> list[int]:
    """Token ids of an extract job's prompt (the chat template applied, thinking off)."""
    context, instructions = job.input.get("context"), job.input.get("instructions")
    if not isinstance(context, str) or not context.strip():
        raise InputJobError("input.context must be a non-empty document")
    if instructions is not None and not isinstance(instructions, str):
        raise InputJobError("input.instructions must be text")
    try:
        return render_extract_prompt(tokenizer, context, job.input.get("schema"), instructions)
    except Exception as exc:  # a template error is the caller's input problem, not a fault
        raise InputJobError(f"the extract prompt cannot be rendered: {exc}") from exc


def render_extract_prompt(
    tokenizer: ChatTokenizer, context: str, schema: Any, instructions: str | None = None
) -> list[int]:
    """The prompt's token ids for valid input (also the demo's training rows, so they match)."""
    text = tokenizer.render_chat(extract_messages(context, schema, instructions), enable_thinking=False)
    return tokenizer.encode(text)


def run_extract(job: JobSpec, ctx: EngineContext) -> Outcome:
    """An ``extract`` job: one sequence, the schema's canvas after the prompt."""
    schema = job.input.get("schema")
    if schema is None:
        raise InputJobError("input.schema is required")
    request = GenerationRequest(
        request_id=job.job_id,
        prompt_ids=extract_prompt_ids(job, ctx.tokenizer),
        params=sampling_params(job.params, ctx.settings),
        slot_class=job.queue,
        deadline=ctx.deadline,
        on_progress=ctx.on_progress,
        cancel_event=ctx.cancel_event,
    )
    return run_structured(request, schema, ctx, field="schema")
