"""A ``generate`` job with tools (``input.tools``, ``tool_choice`` other than ``none``).

``worker.execution.run_generate`` hands such a job here (this module builds on
``worker/job_handler.py`` only, so execution imports it at the top). The prompt already holds
the tools (the chat template rendered them). Then, by ``tool_choice``:

* a named function, or ``required`` with one tool: the call is laid out on the canvas in the
  checkpoint's format (the tags and the name given, the arguments as slots), so its arguments
  validate against the tool's parameters by construction;
* ``required`` with several tools: first a canvas of the call's opening with one choice slot
  among the names (how the model would start the call), then that tool's call canvas: two
  engine requests, the second shares the prompt (and its cached prefix);
* ``auto``: free decoding, then the format's parser (``worker/structured/tool_parsers.py``).
  A malformed call is retried once with a new seed at ``decide_retry_temperature`` (the
  decisions' rule), counted in ``cloverq_invalid_output_retries_total{kind="tool_call"}`` with a
  log line; if the retry is malformed too, the answer is returned as text content, no calls.
  The result's ``usage.attempts`` says how many decodes were made (as a decision's does).

The result's ``text`` is the content outside the calls, ``tool_calls`` the calls in OpenAI's
shape (``arguments`` as JSON text), ``data`` the arguments of a laid-out call.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from scheduler.infra.redis_client import get_redis
from scheduler.jobs.models import JobStatus
from scheduler.jobs.retry import InputJobError
from scheduler.jobs.schema_subset import SchemaError, parse_options
from scheduler.jobs.tool_spec import Tool, ToolError, ToolSpec, parse_tools
from scheduler.observability.logging import get_logger
from scheduler.observability.metrics_recorder import RedisMetricsRecorder
from worker.decisions.runner import RETRY_SEED_OFFSET
from worker.engine.types import GenerationRequest
from worker.job_handler import EngineContext, JobSpec, Outcome, complete_answer, outcome_of
from worker.structured.canvas import Canvas
from worker.structured.tool_parsers import CallFormat, ParsedCall, ParsedCalls, call_format, parse_calls
from worker.structured.tool_render import call_canvas, name_canvas, openai_calls
from worker.thinking import thinking_fields

log = get_logger(__name__)
MAX_ATTEMPTS = 2  # the first decode plus ONE retry of a malformed auto call


def job_tool_spec(job: JobSpec, ctx: EngineContext) -> ToolSpec | None:
    """The job's parsed tools when its output is read for calls, else None."""
    if not job.input.get("tools") or job.input.get("tool_choice") == "none":
        return None
    try:
        spec = parse_tools(job.input.get("tools"), job.input.get("tool_choice"),
                           job.input.get("parallel_tool_calls"), max_tools=ctx.settings.limits.max_tools,
                           options=parse_options(ctx.settings))
    except ToolError as exc:
        raise InputJobError(f"{exc.param}: {exc}") from exc
    return spec if spec.parses else None


def _count_retry(ctx: EngineContext) -> None:
    try:
        RedisMetricsRecorder(get_redis(ctx.settings.resolved_redis_url)).invalid_output_retry(kind="tool_call")
    except Exception as exc:  # metrics are best effort: never fail a job over them
        log.warning("metrics.record_failed", metric="cloverq_invalid_output_retries_total", error=repr(exc))


def _add_usage(outcome: Outcome, earlier: Outcome) -> None:
    """``outcome`` counting the passes and tokens of an earlier request of the same job too."""
    outcome.steps_used += earlier.steps_used
    outcome.tokens += earlier.tokens
    usage = (outcome.result or {}).get("usage")
    if isinstance(usage, dict):
        usage["steps_used"] = outcome.steps_used
        usage["completion_tokens"] = outcome.tokens


def _laid_out(request: GenerationRequest, canvas: Canvas, ctx: EngineContext) -> tuple[Outcome, Any]:
    result = ctx.submit(replace(request, template=canvas.template)).result()
    outcome = outcome_of(result, ctx.tokenizer)
    if outcome.status is not JobStatus.SUCCEEDED or outcome.result is None:
        return outcome, None
    complete_answer(outcome, result)  # the call laid out to its end: complete
    return outcome, canvas.read(result.slot_choices, ctx.tokenizer).value  # type: ignore[arg-type]


def _named(request: GenerationRequest, spec: ToolSpec, fmt: CallFormat, job: JobSpec,
           ctx: EngineContext) -> Outcome:
    earlier: Outcome | None = None
    if spec.mode == "named":
        tool = spec.tool(spec.named or "")
    elif len(spec.tools) == 1:
        tool = spec.tools[0]
    else:  # required over several: the model picks the name first (module docstring)
        names = [t.name for t in spec.tools]
        earlier, name = _laid_out(replace(request, request_id=f"{request.request_id}#tool"),
                                  name_canvas(names, fmt, ctx.tokenizer), ctx)  # type: ignore[arg-type]
        if name is None:
            return earlier
        tool = spec.tool(name)
    assert isinstance(tool, Tool)
    try:
        canvas = call_canvas(tool, fmt, ctx.tokenizer)  # type: ignore[arg-type]
    except SchemaError as exc:
        raise InputJobError(f"tools: {tool.name}: {exc} ({exc.code.value} at {exc.path})") from exc
    outcome, arguments = _laid_out(request, canvas, ctx)
    if earlier is not None:
        _add_usage(outcome, earlier)
    if arguments is not None and outcome.result is not None:
        outcome.result.update(text="", data=arguments,
                              tool_calls=openai_calls([ParsedCall(tool.name, arguments)], job.job_id))
    return outcome


def _auto(request: GenerationRequest, spec: ToolSpec, fmt: CallFormat, job: JobSpec,
          ctx: EngineContext) -> Outcome:
    thinking = bool(job.params.get("thinking"))
    earlier: Outcome | None = None
    for attempt in range(1, MAX_ATTEMPTS + 1):
        outcome = outcome_of(ctx.submit(request).result(), ctx.tokenizer)
        if earlier is not None:
            _add_usage(outcome, earlier)
        if outcome.status is not JobStatus.SUCCEEDED or outcome.result is None:
            return outcome
        if thinking:
            outcome.result.update(thinking_fields(outcome.result["token_ids"], ctx.tokenizer))  # type: ignore[arg-type]
        parsed: ParsedCalls = parse_calls(str(outcome.result["text"]), spec, fmt)
        if parsed.malformed is None or attempt == MAX_ATTEMPTS:
            break
        # an alert line and the decisions' metric: operators watch them to spot a degraded model
        log.warning("tool_call.invalid_model_output", alert=True, job_id=job.job_id, attempt=job.attempt,
                    call_attempt=attempt, retrying=True, reason=parsed.malformed)
        _count_retry(ctx)
        earlier = outcome
        seed = (request.params.seed if request.params.seed is not None else 0) + RETRY_SEED_OFFSET
        temperature = max(request.params.temperature, ctx.settings.decisions.retry_temperature)
        request = replace(request, params=replace(request.params, seed=seed, temperature=temperature))
    if parsed.malformed is not None:
        log.warning("tool_call.returned_as_text", alert=True, job_id=job.job_id, reason=parsed.malformed)
    result: dict[str, Any] = outcome.result or {}
    if isinstance(result.get("usage"), dict):  # decodes made, as a decision's usage says (1 or 2)
        result["usage"]["attempts"] = attempt
    result["text"] = parsed.content
    if parsed.calls:
        result["tool_calls"] = openai_calls(parsed.calls, job.job_id)
    return outcome


def run_with_tools(request: GenerationRequest, spec: ToolSpec, job: JobSpec, ctx: EngineContext) -> Outcome:
    """The job's outcome with its calls read (module docstring)."""
    fmt = call_format(getattr(ctx.tokenizer, "chat_template", None))
    if fmt is None:
        raise InputJobError("tools: this checkpoint's chat template renders no tool calls")
    if spec.mode in ("named", "required"):
        return _named(request, spec, fmt, job, ctx)
    return _auto(request, spec, fmt, job, ctx)
