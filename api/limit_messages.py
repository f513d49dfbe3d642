"""What a limit error tells the client: which setting raises the limit, and for documents what to
do instead (issue 33: "A decision prompt has 37873 tokens (bound); the limit is 4096" named no
setting and said "(bound)" for an exact count).

Every limit refusal names the deployment setting by its environment variable (the one name an
operator can act on) and puts it in ``details.setting`` too, then says what the client can do
instead where there is something: prompt-size refusals offer splitting the document or (a joint
decision) asking independently, an over-large batch splitting it, a full queue or tenant cap
retrying later. (The schema limits' 400 ``schema_too_large`` is worded where it is raised,
``scheduler.jobs.schema_subset``, since the worker raises it too.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from api.errors import ApiError, error_body
from scheduler.access.admission import AdmissionRefused
from scheduler.fleet.context_limits import ContextLimits
from scheduler.infra.settings import Settings, flat_fields


def setting_env(flat_name: str) -> str:
    """The environment variable of a settings field (``max_prompt_tokens`` ->
    ``CLOVERQ_MAX_PROMPT_TOKENS``), from the one settings table."""
    return flat_fields()[flat_name].env


def limit_detail(loc: list[str | int], message: str, value: Any, flat_name: str) -> dict[str, Any]:
    """One ``details`` entry of a 422 ``invalid_request`` for a value over a configured limit."""
    return {"loc": ["body", *loc], "message": message, "type": "limit", "value": value,
            "setting": setting_env(flat_name)}


def over_limit(loc: list[str | int], what: str, value: Any, flat_name: str, *, hint: str = "") -> ApiError:
    """422 ``invalid_request``: ``what`` ("at most 64 questions") with the setting that raises it."""
    message = f"{what} ({setting_env(flat_name)}){hint}"
    return ApiError(422, "invalid_request", message, [limit_detail(loc, message, value, flat_name)])


def counted(tokens: int, exact: bool) -> str:
    """``37873 tokens``, or for the byte bound ``at most 37873 tokens (counted as UTF-8 bytes, ...)``."""
    if exact:
        return f"{tokens} tokens"
    return f"at most {tokens} tokens (counted as UTF-8 bytes, an upper bound: no tokenizer.json here)"


def prompt_too_long(
    subject: str, tokens: int, *, exact: bool, settings: Settings, alternatives: list[str],
    extra: dict[str, Any] | None = None, limits: ContextLimits | None = None,
) -> ApiError:
    """422 ``prompt_too_long``: the count, the limit and where it comes from, then what the client
    can do (``alternatives``, most useful first) before asking the operator to raise the limit.

    ``limits``: the deployment's on the served checkpoint (``scheduler.fleet.context_limits``);
    when the checkpoint's context is the smaller bound, raising the setting cannot help, so the
    message says so instead of offering it."""
    limits = limits or ContextLimits.resolve(settings, None)
    limit, env, context = limits.prompt_tokens, setting_env("max_prompt_tokens"), limits.checkpoint_positions
    details: dict[str, Any] = {"prompt_tokens": tokens, "max_prompt_tokens": limit, "exact": exact,
                               "setting": env}
    if context is not None:
        details |= {"checkpoint_max_positions": context,
                    "limited_by": "checkpoint" if limits.prompt_limited_by_checkpoint else "setting"}
    if limits.prompt_limited_by_checkpoint:
        source = (f"the checkpoint's context, max_position_embeddings; {env} is "
                  f"{limits.setting_prompt_tokens}")
        options = alternatives
    else:
        reach = f" up to the checkpoint's {context}" if context is not None else ""
        source = env
        options = [*alternatives, f"ask the operator to raise {env}{reach} (engine memory per sequence grows "
                   "with it)"]
    message = (f"{subject} has {counted(tokens, exact)}; the limit is {limit} tokens ({source}). "
               f"Instead: {'; or '.join(options)}.")
    return ApiError(422, "prompt_too_long", message, {**details, **(extra or {})})


def instead(alternatives: Sequence[str], env: str) -> str:
    """``Instead: a; or b; or ask the operator to raise ENV.``: what the client can do, most
    useful first, then the setting as the last resort."""
    return f"Instead: {'; or '.join([*alternatives, f'ask the operator to raise {env}'])}."


def body_too_large(max_body_bytes: int, flat_name: str) -> dict[str, Any]:
    """The 413 ``body_too_large`` body: the limit, its setting (``max_body_bytes``, or
    ``batch_max_body_bytes`` for batch uploads) and what to send instead."""
    env = setting_env(flat_name)
    if flat_name == "batch_max_body_bytes":
        alternatives = ["split the jobs into several batches"]
    else:
        alternatives = ["send a smaller request (a long document: split it into parts, one job each; "
                        "POST /v1/batches takes many jobs in one request)"]
    message = (f"The request body is larger than {max_body_bytes} bytes ({env}). "
               f"{instead(alternatives, env)}")
    return error_body("body_too_large", message, {"max_body_bytes": max_body_bytes, "setting": env})


def batch_too_large(jobs: int, settings: Settings) -> ApiError:
    """422 ``batch_too_large``: more job specs than ``batch_max_jobs``; says into how many
    batches to split them."""
    limit, env = settings.batches.max_jobs, setting_env("batch_max_jobs")
    parts = math.ceil(jobs / limit)
    message = (f"A batch holds at most {limit} jobs ({env}); this one has {jobs}. "
               f"{instead([f'split it into {parts} or more batches of at most {limit} jobs'], env)}")
    return ApiError(422, "batch_too_large", message, {"jobs": jobs, "max_jobs": limit, "setting": env})


# The admission refusals' settings (``scheduler.access.admission``) and the field of
# PATCH /v1/admin/limits that overrides them at runtime.
_ADMISSION_SETTINGS = {"queue_full": ("queue_max_depth", "queue_max_depth.{queue}"),
                       "tenant_limit": ("tenant_max_active_jobs", "tenants.<tenant>.max_active")}


def admission_refused(refused: AdmissionRefused) -> ApiError:
    """429 ``queue_full`` / ``tenant_limit``: the refusal's facts, the cap's setting (or that a
    runtime override stands in for it), and to retry after ``Retry-After``."""
    flat_name, field = _ADMISSION_SETTINGS[refused.code]
    env = setting_env(flat_name)
    override = f"PATCH /v1/admin/limits {field.format(**refused.details)}"
    wait = f"retry after {refused.retry_after_seconds} s (the Retry-After header)"
    if refused.code == "tenant_limit":
        wait += ", or once some of the tenant's jobs have finished"
    if refused.overridden:
        source, raised = f"an operator override of {env}", f"the override ({override})"
    else:
        source, raised = env, f"{env} (or override it at runtime: {override})"
    message = f"{refused.message} The cap is {source}. {instead([wait], raised)}"
    return ApiError(429, refused.code, message, {**refused.details, "setting": env},
                    {"Retry-After": str(refused.retry_after_seconds)})
