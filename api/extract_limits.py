"""Deployment limits of ``extract`` jobs (the schema, the prompt's size, steps and budget).

Like :mod:`api.limits` for ``generate`` and :mod:`api.decision_limits` for ``decide``: checked
per request before anything is stored, and the returned params are what the job will run with.
The schema is refused exactly as a generate job's ``response_schema`` is (400 with its code,
``loc`` ``["body", "input", "schema"]``). The output's length is the schema's canvas, known only
to the worker with the tokenizer: a canvas over the engine's room fails the job with
``invalid_input``, as it does for ``response_schema``.
"""

from __future__ import annotations

from typing import Any

from api.block_steps import check_step_limits
from api.context_checks import check_context_memory, context_limits
from api.errors import ApiError
from api.limit_messages import prompt_too_long
from api.prompt_tokens import PromptTokenCounter
from api.schema_check import check_schema
from api.schemas.extract import ExtractInput, ExtractParams
from scheduler.infra.settings import Settings
from scheduler.infra.settings_groups.limits import CHAT_TEMPLATE_SLACK_TOKENS


def check_extract_limits(
    input: ExtractInput, params: ExtractParams, *, settings: Settings, counter: PromptTokenCounter,
    faults_enabled: bool,
) -> dict[str, Any]:
    """Validate an extract job against the limits; return the params to store."""
    check_schema(input.schema_, settings=settings, field="schema")
    steps = check_step_limits(params.steps_per_block, params.block_size, params.step_budget,
                              settings=settings)
    if params.fault is not None and not faults_enabled:
        raise ApiError(422, "invalid_request", "params.fault is only accepted when fault injection is "
                       "enabled (tests).",
                       [{"loc": ["body", "params", "fault"], "message": "not allowed",
                         "type": "forbidden_field"}])
    prompt_tokens = counter.count(input.text_parts())
    limits = context_limits(settings, counter)
    if prompt_tokens > limits.prompt_tokens:
        raise prompt_too_long(
            "The extract prompt (document, instructions and fields)", prompt_tokens, exact=counter.exact,
            settings=settings, limits=limits,
            alternatives=["split the document into parts and extract from each "
                          "(one extract job per part, e.g. a batch: POST /v1/batches)"])
    # the prompt must fit the engine's memory; the canvas comes on top (the worker checks it)
    check_context_memory(prompt_tokens + CHAT_TEMPLATE_SLACK_TOKENS, limits, subject="The extract prompt")
    stored = params.model_dump(exclude_none=True)
    if steps is not None:  # else the worker's model family default
        stored["steps_per_block"] = steps
    return stored
