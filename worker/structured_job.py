"""Decode a schema's canvas after a prompt and read the value back: the one code path of every
job whose output is valid against a JSON Schema by construction.

``generate`` with ``input.response_schema`` (``worker/execution.py``) and ``extract`` with
``input.schema`` (``worker/extract_job.py``) both end here; only their prompts differ. The
canvas itself is ``worker/structured`` (plain Python/torch); this adds the job plumbing (the
planned blocks, the outcome). A schema the canvas cannot lay out is the caller's input problem:
the API refuses it at submit, and one that passes there but not here (the canvas-token limit)
fails the job with ``invalid_input``.
"""

from __future__ import annotations

from typing import Any

from scheduler.jobs.models import JobStatus
from scheduler.jobs.retry import InputJobError
from scheduler.jobs.schema_subset import SchemaError, parse_options
from worker.engine.types import GenerationRequest
from worker.job_handler import EngineContext, Outcome, complete_answer, outcome_of, planned_blocks
from worker.structured.job import read_structured, structured_request


def run_structured(request: GenerationRequest, schema: Any, ctx: EngineContext, *, field: str) -> Outcome:
    """``request`` (its prompt) with ``schema``'s canvas after it: ``text`` is the JSON of a value
    valid against the schema, ``data`` the value, ``confidence`` each choice field's probability
    (by JSON pointer). ``field`` names the input field in an error (``response_schema``, ``schema``)."""
    try:
        request, canvas = structured_request(
            request, schema, ctx.tokenizer, limits=parse_options(ctx.settings)  # type: ignore[arg-type]
        )
    except SchemaError as exc:
        raise InputJobError(f"{field}: {exc} ({exc.code.value} at {exc.path})") from exc
    if ctx.on_plan is not None:  # the canvas's blocks, not max_new_tokens': it decodes exactly those
        ctx.on_plan(blocks_total=planned_blocks(len(request.prompt_ids), len(canvas.template.token_ids),
                                                request.params.block_size or ctx.default_block_size),
                    prompt_tokens=len(request.prompt_ids))
    result = ctx.submit(request).result()
    outcome = outcome_of(result, ctx.tokenizer)
    if outcome.status is JobStatus.SUCCEEDED and outcome.result is not None:
        read = read_structured(canvas, result, ctx.tokenizer)  # type: ignore[arg-type]
        outcome.result.update(text=read.text, data=read.value, confidence=read.confidence)
        complete_answer(outcome, result)
    return outcome
