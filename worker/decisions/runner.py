"""Run one decision on the engine, with the one automatic retry for invalid free text.

The caller (the Celery task) passes ``submit`` — the engine's ``Engine.submit`` — and gets a
``DecisionOutcome`` back. Device faults raised by the engine's futures propagate unchanged so
the task's transient-fault retry handles them; everything else becomes an outcome.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from scheduler.jobs.error_codes import ErrorCode
from worker.decisions.assemble import IncompleteOutput, InvalidModelOutput, assemble_result
from worker.decisions.planner import DecisionPlan, plan_decision
from worker.decisions.spec import DecisionSpec, DecisionTokenizer
from worker.engine.types import FinishReason, GenerationRequest, GenerationResult, Progress, SamplingParams

# Added to the seed of the retry so it draws a different stream.
RETRY_SEED_OFFSET = 1_000_003
# Finish reasons that end the decision without an answer.
_STOPPED = (FinishReason.CANCELLED, FinishReason.DEADLINE, FinishReason.ERROR)


@dataclass(frozen=True)
class DecisionFaults:
    """Test-only fault injection (never set in production: the task reads it from
    ``params.fault`` only when the test-fault setting is enabled)."""

    invalid_rationale_attempts: int = 0  # this many first attempts get an invalid rationale


@dataclass(frozen=True)
class DecisionOptions:
    """Knobs from settings."""

    rationale_tokens: int = 24
    rationale_max_chars: int = 400
    retry_temperature: float = 0.7  # the retry samples: a greedy retry would repeat the failure
    max_attempts: int = 2  # the first try plus ONE automatic retry
    joint_one_pass: bool = False  # a joint decision without rationales: every answer in one pass


@dataclass
class DecisionOutcome:
    """What the task writes back: a result, or a stop / error code with a message."""

    result: dict[str, Any] | None
    finish_reason: FinishReason
    error_code: ErrorCode | None = None
    error_message: str | None = None
    steps_used: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    sequences: int = 0
    attempts: int = 0


def _retry_params(params: SamplingParams, options: DecisionOptions) -> SamplingParams:
    seed = (params.seed if params.seed is not None else 0) + RETRY_SEED_OFFSET
    return replace(params, seed=seed, temperature=max(params.temperature, options.retry_temperature))


SubmitMany = Callable[[Sequence[GenerationRequest]], list[Future[GenerationResult]]]


def _gather(
    requests: tuple[GenerationRequest, ...],
    submit: Callable[[GenerationRequest], Future[GenerationResult]],
    submit_many: SubmitMany | None = None,
) -> list[GenerationResult]:
    # all at once: the engine batches them; with ``submit_many`` they also join one admission
    # round, so an independent decision's shared context is prefilled once (the prefix cache)
    futures = submit_many(requests) if submit_many is not None else [submit(r) for r in requests]
    return [future.result() for future in futures]


def run_decision(
    spec: DecisionSpec,
    *,
    tokenizer: DecisionTokenizer,
    submit: Callable[[GenerationRequest], Future[GenerationResult]],
    request_id: str,
    params: SamplingParams,
    slot_class: str,
    options: DecisionOptions = DecisionOptions(),
    faults: DecisionFaults = DecisionFaults(),
    deadline: float | None = None,
    cancel_event: threading.Event | None = None,
    on_invalid_output: Callable[[int, str], None] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    submit_many: SubmitMany | None = None,
    on_plan: Callable[[DecisionPlan], None] | None = None,
) -> DecisionOutcome:
    """Decode the decision; retry once with a new seed when a rationale is invalid.

    ``submit_many`` (the engine's ``Engine.submit_many``), when given, queues an attempt's
    sequences together, so that they share their context's prefill.

    ``on_plan(plan)`` is told each attempt's requests before they are submitted (the worker
    derives the job's planned blocks from them). ``on_invalid_output(attempt, reason)`` is called
    for every invalid attempt (the task logs an alert line and counts the metric there). A second
    invalid attempt ends with error code ``invalid_model_output``.
    """
    cancel = cancel_event or threading.Event()
    outcome = DecisionOutcome(result=None, finish_reason=FinishReason.ERROR)
    attempt_params = params
    for attempt in range(options.max_attempts):
        plan = plan_decision(
            spec, tokenizer, request_id=f"{request_id}:a{attempt}", params=attempt_params,
            rationale_tokens=options.rationale_tokens, slot_class=slot_class, deadline=deadline,
            cancel_event=cancel, on_progress=on_progress, joint_one_pass=options.joint_one_pass,
        )
        if on_plan is not None:
            on_plan(plan)
        results = _gather(plan.requests, submit, submit_many)
        outcome.attempts = attempt + 1
        outcome.sequences += len(results)
        outcome.steps_used += sum(r.steps_used for r in results)
        outcome.tokens += sum(r.tokens for r in results)
        outcome.prompt_tokens += sum(r.prompt_tokens for r in results)
        stopped = next((r for r in results if r.finish_reason in _STOPPED), None)
        if stopped is not None:
            outcome.finish_reason = stopped.finish_reason
            error = stopped.finish_reason is FinishReason.ERROR
            outcome.error_code = ErrorCode.INVALID_INPUT if error else None
            outcome.error_message = stopped.error
            return outcome
        try:
            outcome.result = assemble_result(
                plan, results, tokenizer, rationale_max_chars=options.rationale_max_chars,
                corrupt_rationale=attempt < faults.invalid_rationale_attempts,
            )
        except InvalidModelOutput as exc:
            if on_invalid_output is not None:
                on_invalid_output(attempt + 1, str(exc))
            outcome.error_code, outcome.error_message = ErrorCode.INVALID_MODEL_OUTPUT, str(exc)
            attempt_params = _retry_params(params, options)
            continue
        except IncompleteOutput as exc:
            budget = any(r.finish_reason is FinishReason.BUDGET for r in results)
            outcome.finish_reason = FinishReason.BUDGET if budget else FinishReason.ERROR
            outcome.error_code = ErrorCode.BUDGET_EXHAUSTED if budget else ErrorCode.INCOMPLETE_OUTPUT
            outcome.error_message = str(exc)
            return outcome
        outcome.finish_reason = FinishReason.EOS
        outcome.error_code = outcome.error_message = None
        outcome.result["usage"] = {
            "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": outcome.tokens,
            "steps_used": outcome.steps_used,
            "sequences": outcome.sequences,
            "attempts": outcome.attempts,
        }
        if spec.mode == "joint":  # which decode answered it (the setting, or the checkpoint's declaration)
            one_pass = (template := plan.requests[0].template) is not None and template.one_pass
            outcome.result["usage"]["joint_decode"] = "one_pass" if one_pass else "blockwise"
        return outcome
    outcome.finish_reason = FinishReason.ERROR
    return outcome
