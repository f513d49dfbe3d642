"""Deployment limits of ``decide`` jobs (question count, choices, context size, budget).

Like :mod:`api.limits` for ``generate``: checked per request, reported as 422 with the
offending field, and the returned params are what the job will run with (defaults filled in,
e.g. the joint queue's own default step budget).
"""

from __future__ import annotations

from typing import Any

from api.block_steps import check_steps_fit_block
from api.errors import ApiError
from api.prompt_tokens import PromptTokenCounter
from api.schemas.decisions import DecideInput, DecideParams
from scheduler.settings import Settings

# Test-only fault names of decisions (honoured only with settings.worker.fault_injection).
DECIDE_FAULTS = ("invalid_rationale_once", "invalid_rationale_always")


def _invalid(loc: list[str | int], message: str, value: Any = None) -> ApiError:
    return ApiError(422, "invalid_request", message,
                    [{"loc": ["body", *loc], "message": message, "type": "limit", "value": value}])


def check_decide_limits(
    input: DecideInput, params: DecideParams, *, settings: Settings, counter: PromptTokenCounter,
    faults_enabled: bool,
) -> dict[str, Any]:
    """Validate a decision against the limits; return the params to store."""
    if len(input.questions) > settings.decisions.max_questions:
        raise _invalid(["input", "questions"], f"at most {settings.decisions.max_questions} questions",
                       len(input.questions))
    for i, question in enumerate(input.questions):
        if len(question.choices) > settings.decisions.max_choices:
            raise _invalid(["input", "questions", i, "choices"],
                           f"at most {settings.decisions.max_choices} choices", len(question.choices))
    if len(input.context) > settings.decisions.max_context_chars:
        raise _invalid(["input", "context"], f"at most {settings.decisions.max_context_chars} characters",
                       len(input.context))
    steps = check_steps_fit_block(params.steps_per_block, params.block_size,
                                  settings.limits.default_steps_per_block)
    if steps is not None and steps > settings.limits.max_steps_per_block:
        raise _invalid(["params", "steps_per_block"], f"at most {settings.limits.max_steps_per_block}", steps)
    if params.step_budget is not None and params.step_budget > settings.limits.max_step_budget:
        raise _invalid(["params", "step_budget"], f"at most {settings.limits.max_step_budget}",
                       params.step_budget)
    if params.fault is not None and (not faults_enabled or params.fault not in DECIDE_FAULTS):
        raise _invalid(["params", "fault"], "params.fault is only accepted when fault injection is enabled "
                       f"(tests), one of {list(DECIDE_FAULTS)}", params.fault)
    # Joint: one sequence holds the context and every question; independent: the context and
    # one question (the longest one bounds them all).
    if input.mode == "joint":
        texts = input.text_parts()
    else:
        texts = [input.context, max((q.text for q in input.questions), key=len)]
    prompt_tokens = counter.count(texts)
    if prompt_tokens > settings.limits.max_prompt_tokens:
        raise ApiError(422, "prompt_too_long",
                       f"A decision prompt has {prompt_tokens} tokens (bound); the limit is "
                       f"{settings.limits.max_prompt_tokens}.",
                       {"prompt_tokens": prompt_tokens,
                        "max_prompt_tokens": settings.limits.max_prompt_tokens, "exact": counter.exact})
    stored = params.model_dump(exclude_none=True)
    if steps is not None:  # else the worker's model family default
        stored["steps_per_block"] = steps
    if input.mode == "joint" and params.step_budget is None:
        stored["step_budget"] = settings.decisions.joint_default_step_budget
    return stored
