"""Deployment limits on a job request, checked against ``Settings`` before anything is stored.

Static shape rules live in the pydantic models; the limits here depend on configuration, so
they are checked per request and reported as 422 ``invalid_request`` (or ``prompt_too_long``, and
from ``api/context_checks.py`` ``request_too_long`` / ``context_exceeds_memory``) with the
offending field or the figures in ``details``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from api.block_steps import check_steps_fit_block
from api.context_checks import check_context_memory, check_sequence_room, context_limits
from api.decision_limits import check_decide_limits
from api.errors import ApiError
from api.extract_limits import check_extract_limits
from api.limit_messages import limit_detail, prompt_too_long, setting_env
from api.prompt_tokens import PromptTokenCounter
from api.schema_check import check_schema
from api.schemas.jobs import DecideJobCreate, ExtractJobCreate, GenerateInput, GenerateJobCreate
from scheduler.infra.settings import Settings
from scheduler.infra.settings_groups.limits import CHAT_TEMPLATE_SLACK_TOKENS
from scheduler.jobs.schema_subset import parse_options
from scheduler.jobs.tool_spec import ToolError, parse_tools
from scheduler.webhooks.ssrf_guard import WebhookTargetError, check_url


def _limit_error(field: str, value: int, limit: int, flat_name: str) -> ApiError:
    message = f"params.{field} must be at most {limit} ({setting_env(flat_name)})."
    return ApiError(422, "invalid_request", message,
                    [limit_detail(["params", field], f"at most {limit}", value, flat_name)])


def metadata_bytes(metadata: Mapping[str, Any]) -> int:
    """The size ``metadata`` is measured by: compact JSON, UTF-8 (as it is stored and echoed)."""
    return len(json.dumps(metadata, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


def check_metadata(
    metadata: Mapping[str, Any] | None, *, settings: Settings, loc: Sequence[str | int] = ("body", "metadata")
) -> None:
    """422 ``metadata_too_large`` when ``metadata`` exceeds ``settings.limits.max_metadata_bytes``."""
    if not metadata:
        return
    size = metadata_bytes(metadata)
    if size > settings.limits.max_metadata_bytes:
        cap = settings.limits.max_metadata_bytes
        env = setting_env("max_metadata_bytes")
        message = (f"metadata is {size} bytes as JSON; at most {cap} are accepted ({env}): keep large "
                   "values (documents) in the input and ids in metadata.")
        raise ApiError(422, "metadata_too_large", message,
                       [{"loc": list(loc), "message": message, "type": "limit", "value": size,
                         "setting": env}])


def check_webhook_url(
    url: str | None, *, settings: Settings, loc: Sequence[str | int] = ("body", "webhook_url")
) -> None:
    """422 ``invalid_webhook_url`` for a URL the service would never deliver to (credentials,
    loopback/private literal addresses, localhost names; see ``scheduler.webhooks.ssrf_guard.check_url``).
    Names that resolve to refused addresses are refused again at every delivery."""
    if url is None:
        return
    try:
        check_url(url, settings)
    except WebhookTargetError as exc:
        message = f"webhook_url is refused: {exc}."
        raise ApiError(422, "invalid_webhook_url", message,
                       [{"loc": list(loc), "message": str(exc), "type": "webhook_url_refused"}]) from None


def check_tools(input: GenerateInput, *, settings: Settings) -> None:
    """400 with a ``ToolErrorCode`` (``invalid_tools``, ``invalid_tool_name``, ``too_many_tools``,
    ``invalid_tool_choice``, ``unknown_tool``) or, for a tool's ``parameters`` outside the schema
    subset, the ``SchemaErrorCode``: the same parse the worker runs (``scheduler.jobs.tool_spec``)."""
    if input.tools is None and input.tool_choice is None:
        return
    try:
        parse_tools(input.tools, input.tool_choice, input.parallel_tool_calls,
                    max_tools=settings.limits.max_tools, options=parse_options(settings))
    except ToolError as exc:
        field = "tool_choice" if exc.param.startswith("tool_choice") else "tools"
        rest = exc.param[len(field):]
        loc: list[str | int] = ["body", "input", field]
        loc += [int(p) if p.isdigit() else p for p in rest.replace("[", ".").replace("]", "").split(".") if p]
        raise ApiError(400, exc.code, f"input.{exc.param}: {exc}.",
                       [{"loc": loc, "message": str(exc), "type": exc.code, **exc.details()}]) from None


def check_job_limits(
    body: GenerateJobCreate | DecideJobCreate | ExtractJobCreate,
    *,
    settings: Settings,
    counter: PromptTokenCounter,
    faults_enabled: bool,
) -> dict[str, Any]:
    """Every deployment limit of one job spec (``POST /v1/jobs`` and each spec of a batch):
    the kind's own limits, the metadata size and the webhook target. Returns the params to store."""
    if isinstance(body, DecideJobCreate):
        params = check_decide_limits(body.input, body.params, settings=settings, counter=counter,
                                     faults_enabled=faults_enabled)
    elif isinstance(body, ExtractJobCreate):
        params = check_extract_limits(body.input, body.params, settings=settings, counter=counter,
                                      faults_enabled=faults_enabled)
    else:
        params = check_generate_limits(body, settings=settings, counter=counter,
                                       faults_enabled=faults_enabled)
    check_metadata(body.metadata, settings=settings)
    check_webhook_url(str(body.webhook_url) if body.webhook_url is not None else None, settings=settings)
    return params


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
    check_schema(body.input.response_schema, settings=settings, field="response_schema")
    check_tools(body.input, settings=settings)
    params = body.params
    # Thinking jobs get larger defaults (they write the reasoning before the answer).
    thinking = settings.thinking.default if params.thinking is None else params.thinking
    default_new = (settings.thinking.default_max_new_tokens if thinking
                   else settings.limits.default_max_new_tokens)
    max_new_tokens = params.max_new_tokens or default_new
    steps_per_block = check_steps_fit_block(params.steps_per_block, params.block_size,
                                            settings.limits.default_steps_per_block)
    if max_new_tokens > settings.limits.max_new_tokens_limit:
        raise _limit_error("max_new_tokens", max_new_tokens, settings.limits.max_new_tokens_limit,
                           "max_new_tokens_limit")
    if steps_per_block is not None and steps_per_block > settings.limits.max_steps_per_block:
        raise _limit_error("steps_per_block", steps_per_block, settings.limits.max_steps_per_block,
                           "max_steps_per_block")
    if params.step_budget is not None and params.step_budget > settings.limits.max_step_budget:
        raise _limit_error("step_budget", params.step_budget, settings.limits.max_step_budget,
                           "max_step_budget")
    if params.fault is not None and not faults_enabled:
        raise ApiError(
            422,
            "invalid_request",
            "params.fault is only accepted when fault injection is enabled (tests).",
            [{"loc": ["body", "params", "fault"], "message": "not allowed", "type": "forbidden_field"}],
        )

    prompt_tokens = counter.count(body.input.text_parts())
    limits = context_limits(settings, counter)
    if prompt_tokens > limits.prompt_tokens:
        raise prompt_too_long("The prompt", prompt_tokens, exact=counter.exact, settings=settings,
                              limits=limits,
                              alternatives=["shorten it, or split a long document into parts, one job each"])

    # The engine holds prompt + generated region (rounded up to whole blocks) per sequence; a
    # request that cannot fit, or whose K/V and state exceed the engine's whole budget, is refused
    # here, not failed by the worker. Without a block size the checkpoint's applies; the default
    # engine_max_len fits every accepted request then.
    positions = check_sequence_room(prompt_tokens, max_new_tokens, params.block_size or 1, limits)
    check_context_memory(positions + CHAT_TEMPLATE_SLACK_TOKENS, limits,
                         subject="The prompt with its chat template and output")

    stored = params.model_dump(exclude_none=True)
    stored["max_new_tokens"] = max_new_tokens
    if steps_per_block is not None:  # else the worker's model family default
        stored["steps_per_block"] = steps_per_block
    stored["thinking"] = thinking
    if thinking and params.step_budget is None:
        stored["step_budget"] = min(settings.thinking.default_step_budget, settings.limits.max_step_budget)
    return stored
