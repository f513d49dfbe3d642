"""The ``decide`` kind for the worker: job row -> decision on the engine -> job outcome.

Registered in ``worker.execution.KIND_HANDLERS``; builds on ``worker.job_handler`` (not on
``execution``, which imports this module). The decision logic itself is pure
(``worker.decisions``); this adapter adds the job plumbing: settings, the test-only fault knob,
the alert log line and metric for invalid model output, and the mapping to an ``Outcome``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from scheduler.infra.redis_client import get_redis
from scheduler.jobs.models import ErrorCode, JobStatus, QueueName
from scheduler.jobs.retry import InputJobError
from scheduler.observability.logging import get_logger
from scheduler.observability.metrics_recorder import RedisMetricsRecorder
from worker.decisions import DecisionFaults, DecisionSpec, run_decision
from worker.decisions.planner import DecisionPlan
from worker.decisions.runner import DecisionOptions, DecisionOutcome
from worker.engine.types import FinishReason
from worker.job_handler import EngineContext, JobSpec, Outcome, planned_blocks, sampling_params

log = get_logger(__name__)

# params.fault values (honoured only when settings.worker.fault_injection is on: tests).
FAULTS = {
    "invalid_rationale_once": DecisionFaults(invalid_rationale_attempts=1),
    "invalid_rationale_always": DecisionFaults(invalid_rationale_attempts=10**6),
}


def _count_invalid_output(ctx: EngineContext) -> None:
    try:
        RedisMetricsRecorder(get_redis(ctx.settings.resolved_redis_url)).invalid_output_retry(kind="decide")
    except Exception as exc:  # metrics are best effort: never fail a job over them
        log.warning("metrics.record_failed", metric="cloverq_invalid_output_retries_total", error=repr(exc))


def _plan_reporter(ctx: EngineContext) -> Callable[[DecisionPlan], None] | None:
    """Tell the monitor a decision's planned blocks: the sum over its sequences (one for a joint
    decision, one per question otherwise), as their summed progress counts towards it."""
    report = ctx.on_plan
    if report is None:
        return None

    def plan(decision_plan: DecisionPlan) -> None:
        counts = [planned_blocks(len(r.prompt_ids), r.params.max_new_tokens,
                                 r.params.block_size or ctx.default_block_size)
                  for r in decision_plan.requests]
        prompts = sum(len(r.prompt_ids) for r in decision_plan.requests)  # before any prefix sharing
        if counts and all(count is not None for count in counts):
            report(blocks_total=sum(count or 0 for count in counts), prompt_tokens=prompts)
        else:
            report(prompt_tokens=prompts)

    return plan


def _outcome(decision: DecisionOutcome) -> Outcome:
    common: dict[str, Any] = {"steps_used": decision.steps_used, "tokens": decision.tokens,
              "prompt_tokens": decision.prompt_tokens, "finish_reason": decision.finish_reason.value}
    if decision.result is not None:
        return Outcome(JobStatus.SUCCEEDED, decision.result, **common)
    if decision.finish_reason is FinishReason.CANCELLED:
        return Outcome(JobStatus.CANCELLED, None, **common)
    if decision.finish_reason is FinishReason.DEADLINE:
        return Outcome(JobStatus.FAILED, None, error_code=ErrorCode.DEADLINE_EXCEEDED.value,
                       error_message="the attempt ran past its deadline", **common)
    code = (decision.error_code or ErrorCode.INTERNAL).value
    return Outcome(JobStatus.FAILED, None, error_code=code, error_message=decision.error_message, **common)


def resolve_joint_decode(setting: str, checkpoint: str | None) -> str:
    """The joint decode a job runs with: the setting, or for ``auto`` the checkpoint's declared
    one (``generation_config.json`` ``joint_decode``), else ``blockwise``."""
    return (checkpoint or "blockwise") if setting == "auto" else setting


def run_decide(job: JobSpec, ctx: EngineContext) -> Outcome:
    """A ``decide`` job: all its sequences through the engine at once, gathered, assembled."""
    try:
        spec = DecisionSpec.from_input(job.input)
    except (KeyError, TypeError, ValueError) as exc:
        raise InputJobError(f"invalid decision input: {exc}") from exc
    settings = ctx.settings
    fault = job.params.get("fault") if settings.worker.fault_injection else None
    options = DecisionOptions(
        rationale_tokens=settings.decisions.rationale_tokens,
        rationale_max_chars=settings.decisions.rationale_max_chars,
        retry_temperature=settings.decisions.retry_temperature,
        joint_one_pass=resolve_joint_decode(settings.decisions.joint_decode, ctx.joint_decode) == "one_pass",
    )

    def on_invalid_output(attempt: int, reason: str) -> None:
        # An alert line: operators watch for it (and the metric) to spot a degraded model.
        log.warning("decision.invalid_model_output", alert=True, job_id=job.job_id, attempt=job.attempt,
                    decision_attempt=attempt, retrying=attempt < options.max_attempts, reason=reason)
        _count_invalid_output(ctx)

    params = replace(sampling_params(job.params, settings), max_new_tokens=1)  # planner sets the length
    decision = run_decision(
        spec,
        tokenizer=ctx.tokenizer,  # type: ignore[arg-type]  # the worker's Tokenizer has every member
        submit=ctx.submit,
        request_id=job.job_id,
        params=params,
        slot_class=QueueName.JOINT.value if spec.mode == "joint" else job.queue,
        options=options,
        faults=FAULTS.get(str(fault), DecisionFaults()) if fault else DecisionFaults(),
        deadline=ctx.deadline,
        cancel_event=ctx.cancel_event,
        on_invalid_output=on_invalid_output,
        on_progress=ctx.on_progress,
        submit_many=ctx.submit_many,
        on_plan=_plan_reporter(ctx),
    )
    if decision.error_code == ErrorCode.INVALID_MODEL_OUTPUT:
        log.warning("decision.failed_invalid_model_output", alert=True, job_id=job.job_id,
                    attempts=decision.attempts)
    return _outcome(decision)
