"""Deployment limits of ``decide`` jobs (question count, choices, context size, budget).

Like :mod:`api.limits` for ``generate``: checked per request, reported as 422 with the
offending field, and the returned params are what the job will run with (defaults filled in,
e.g. the joint queue's own default step budget).
"""

from __future__ import annotations

from typing import Any

from api.block_steps import check_step_limits
from api.context_checks import check_context_memory, context_limits
from api.errors import ApiError
from api.limit_messages import over_limit, prompt_too_long
from api.prompt_tokens import PromptTokenCounter
from api.schemas.decisions import DecideInput, DecideParams
from scheduler.fleet.context_limits import ContextLimits
from scheduler.infra.settings import Settings
from scheduler.infra.settings_groups.limits import CHAT_TEMPLATE_SLACK_TOKENS

# Test-only fault names of decisions (honoured only with settings.worker.fault_injection).
DECIDE_FAULTS = ("invalid_rationale_once", "invalid_rationale_always")


def check_decide_limits(
    input: DecideInput, params: DecideParams, *, settings: Settings, counter: PromptTokenCounter,
    faults_enabled: bool,
) -> dict[str, Any]:
    """Validate a decision against the limits; return the params to store."""
    limits = settings.decisions
    if len(input.questions) > limits.max_questions:
        raise over_limit(["input", "questions"], f"at most {limits.max_questions} questions",
                         len(input.questions), "decide_max_questions",
                         hint="; split them over several decisions (a batch)")
    for i, question in enumerate(input.questions):
        if len(question.choices) > limits.max_choices:
            raise over_limit(["input", "questions", i, "choices"], f"at most {limits.max_choices} choices",
                             len(question.choices), "decide_max_choices")
    if len(input.context) > limits.max_context_chars:
        raise over_limit(["input", "context"], f"at most {limits.max_context_chars} characters",
                         len(input.context), "decide_max_context_chars",
                         hint="; split the document into parts and decide each (a batch)")
    steps = check_step_limits(params.steps_per_block, params.block_size, params.step_budget,
                              settings=settings)
    if params.fault is not None and (not faults_enabled or params.fault not in DECIDE_FAULTS):
        message = ("params.fault is only accepted when fault injection is enabled "
                   f"(tests), one of {list(DECIDE_FAULTS)}")
        raise ApiError(422, "invalid_request", message, [
            {"loc": ["body", "params", "fault"], "message": message, "type": "limit", "value": params.fault}])
    # Joint: one sequence holds the context and every question; independent: the context and
    # one question (the longest one bounds them all).
    independent_texts = [input.context, max((q.text for q in input.questions), key=len)]
    texts = input.text_parts() if input.mode == "joint" else independent_texts
    prompt_tokens = counter.count(texts)
    context = context_limits(settings, counter)
    if prompt_tokens > context.prompt_tokens:
        raise _decision_too_long(input, prompt_tokens, counter.count(independent_texts), settings=settings,
                                 exact=counter.exact, limits=context)
    # one sequence (joint: every question; independent: the context and its longest question) must
    # fit the engine's memory; the answers' few positions come on top (the worker checks those)
    check_context_memory(prompt_tokens + CHAT_TEMPLATE_SLACK_TOKENS, context,
                         subject=f"A sequence of this {input.mode} decision")
    stored = params.model_dump(exclude_none=True)
    if steps is not None:  # else the worker's model family default
        stored["steps_per_block"] = steps
    if input.mode == "joint" and params.step_budget is None:
        stored["step_budget"] = settings.decisions.joint_default_step_budget
    return stored


def _decision_too_long(
    input: DecideInput, tokens: int, independent_tokens: int, *, settings: Settings, exact: bool,
    limits: ContextLimits,
) -> ApiError:
    """``prompt_too_long`` for a decision, with what would fit: independent mode when the context
    and one question fit (a joint decision only), else parts of the document small enough."""
    limit = limits.prompt_tokens
    alternatives = []
    if input.mode == "joint" and independent_tokens <= limit:
        alternatives.append(f'mode "independent" (each question asked with the context alone: '
                            f'{independent_tokens} tokens, within the limit)')
    parts = max(2, -(-tokens // max(1, limit)))  # the questions' share ignored: "or more"
    alternatives.append(f"split the context into {parts} or more parts and decide each part "
                        "(one decision job per part, e.g. a batch: POST /v1/batches)")
    article = "An" if input.mode == "independent" else "A"
    return prompt_too_long(f"{article} {input.mode} decision prompt", tokens, exact=exact, settings=settings,
                           limits=limits, alternatives=alternatives,
                           extra={"mode": input.mode, "independent_prompt_tokens": independent_tokens})
