"""Deployment limits on a job request, checked against ``Settings`` before anything is stored.

Static shape rules live in the pydantic models; the limits here depend on configuration, so
they are checked per request and reported as 422 ``invalid_request`` (or ``prompt_too_long``)
with the offending field in ``details``.
"""

from __future__ import annotations

from typing import Any

from api.errors import ApiError
from api.prompt_tokens import PromptTokenCounter
from api.schemas.jobs import GenerateJobCreate
from scheduler.settings import Settings


def _limit_error(field: str, value: int, limit: int) -> ApiError:
    return ApiError(
        422,
        "invalid_request",
        f"params.{field} must be at most {limit}.",
        [{"loc": ["body", "params", field], "message": f"at most {limit}", "type": "limit", "value": value}],
    )


def check_generate_limits(
    body: GenerateJobCreate,
    *,
    settings: Settings,
    counter: PromptTokenCounter,
    faults_enabled: bool,
) -> dict[str, Any]:
    """Validate ``body`` against the limits and return the params to store (defaults filled in).

    Filling the defaults here means the stored row records exactly what the job will run with,
    even if the deployment's defaults change while it waits in the queue.
    """
    params = body.params
    # Thinking jobs get larger defaults (they write the reasoning before the answer).
    thinking = settings.default_thinking if params.thinking is None else params.thinking
    default_new = settings.thinking_default_max_new_tokens if thinking else settings.default_max_new_tokens
    max_new_tokens = params.max_new_tokens or default_new
    steps_per_block = params.steps_per_block or settings.default_steps_per_block
    if max_new_tokens > settings.max_new_tokens_limit:
        raise _limit_error("max_new_tokens", max_new_tokens, settings.max_new_tokens_limit)
    if steps_per_block > settings.max_steps_per_block:
        raise _limit_error("steps_per_block", steps_per_block, settings.max_steps_per_block)
    if params.step_budget is not None and params.step_budget > settings.max_step_budget:
        raise _limit_error("step_budget", params.step_budget, settings.max_step_budget)
    if params.fault is not None and not faults_enabled:
        raise ApiError(
            422,
            "invalid_request",
            "params.fault is only accepted when fault injection is enabled (tests).",
            [{"loc": ["body", "params", "fault"], "message": "not allowed", "type": "forbidden_field"}],
        )

    prompt_tokens = counter.count(body.input.text_parts())
    if prompt_tokens > settings.max_prompt_tokens:
        unit = "tokens" if counter.exact else "bytes (upper bound of tokens)"
        raise ApiError(
            422,
            "prompt_too_long",
            f"The prompt has {prompt_tokens} {unit}; the limit is {settings.max_prompt_tokens} tokens.",
            {"prompt_tokens": prompt_tokens, "max_prompt_tokens": settings.max_prompt_tokens,
             "exact": counter.exact},
        )

    # The engine holds prompt + generated region (rounded up to whole blocks) per sequence; a
    # request that cannot fit is refused here, not failed by the worker. Without a block size the
    # checkpoint's applies; the default engine_max_len fits every accepted request then.
    block = params.block_size or 1
    positions = -(-(prompt_tokens + max_new_tokens) // block) * block
    if positions > settings.resolved_engine_max_len:
        raise ApiError(
            422,
            "request_too_long",
            f"Prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) in blocks of {block} "
            f"needs {positions} positions; the engine holds {settings.resolved_engine_max_len}.",
            {"positions": positions, "engine_max_len": settings.resolved_engine_max_len},
        )

    stored = params.model_dump(exclude_none=True)
    stored["max_new_tokens"] = max_new_tokens
    stored["steps_per_block"] = steps_per_block
    stored["thinking"] = thinking
    if thinking and params.step_budget is None:
        stored["step_budget"] = min(settings.thinking_default_step_budget, settings.max_step_budget)
    return stored
