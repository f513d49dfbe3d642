"""Cost estimate, priority class and queue of a job: short requests first, nobody starves.

Cost = the token-predictions the engine will make, which is what occupies a batch slot: every
denoising pass predicts each position of its block, so cost = passes x block size, with passes =
blocks x steps per block (capped by a step budget), per question for decisions. A request that
names no block size runs with the checkpoint's, unknown here: its cost is then generated tokens
x steps (each block's passes times its positions, ignoring the round-up to whole blocks). An
``extract`` job decodes exactly its schema's canvas, so its generated tokens are the canvas's
estimated positions (``scheduler/jobs/canvas_size.py``), not ``max_new_tokens``. The prompt
counts too (issue 26): its tokens, as the API counted them with the checkpoint's tokenizer, at
``prefill_token_cost`` each (a decision's context once: its questions share its prefill through
the prefix cache). Cheap jobs go to ``interactive``, mid-sized to ``standard``, the rest to
``bulk``; joint-mode decisions go to their own ``joint`` queue (own workers, own deadline, capped
engine slots).

A client may ask for a *lower* class than its cost earns (e.g. batch work it does not want to
compete with interactive traffic) but never a higher one. Starvation is bounded by aging: the
beat task ``promote_aged_jobs`` moves any job queued longer than ``aging_seconds`` into
``interactive`` (see ``scheduler/maintenance/tasks.py``).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scheduler.infra.queue_names import PRIORITY_CLASSES
from scheduler.infra.settings import Settings
from scheduler.jobs.canvas_size import estimate_canvas_tokens
from scheduler.jobs.models import JobKind, QueueName
from scheduler.jobs.schema_subset import ParseOptions, SchemaError, parse_options, parse_schema

# Classes a client may name in ``priority``: PRIORITY_CLASSES; ranks follow QueueName order.
# Friendly aliases accepted for ``priority``.
PRIORITY_ALIASES: Mapping[str, QueueName] = {
    "high": QueueName.INTERACTIVE,
    "normal": QueueName.STANDARD,
    "low": QueueName.BULK,
}


# Positions per pass assumed for a step budget's cap when a request names no block size.
BUDGET_BLOCK_ASSUMED = 4
STEPS_ASSUMED = 4  # steps per block when neither the job nor the deployment names them


class InvalidPriorityError(ValueError):
    """The requested priority names no class."""


@dataclass(frozen=True)
class Route:
    """Where a job goes and why."""

    cost: int
    priority: QueueName  # the class (what the job earned, possibly lowered by the client)
    queue: QueueName  # the Celery queue it is published to


def parse_priority(priority: str | None) -> QueueName | None:
    """A client's ``priority`` as a class, or None when not given."""
    if priority is None:
        return None
    key = priority.strip().lower()
    if key in PRIORITY_ALIASES:
        return PRIORITY_ALIASES[key]
    try:
        cls = QueueName(key)
    except ValueError as exc:
        raise InvalidPriorityError(f"unknown priority {priority!r}") from exc
    if cls not in PRIORITY_CLASSES:
        raise InvalidPriorityError(f"priority {priority!r} cannot be requested")
    return cls


def estimate_cost(
    *, kind: str, input: Mapping[str, Any] | None, params: Mapping[str, Any], settings: Settings,
    prompt_tokens: int = 0,
) -> int:
    """Passes x block size (x questions): an upper bound of the token-predictions of the job, plus
    its ``prompt_tokens`` (every text of the input, counted by the API) at ``prefill_token_cost``.

    ``steps_per_block`` above ``block_size`` is refused by the API (``api.limits``); here such
    steps count as the block size, the most passes a block can take (a pass commits >= 1 mask).
    A step budget caps the decoding only: the prompt is prefilled whatever the budget.
    """
    block = int(params.get("block_size") or 0)  # 0: the checkpoint's, unknown here
    # unset everywhere: the model family's default, unknown here; assume 4 passes per block
    steps = int(params.get("steps_per_block") or settings.limits.default_steps_per_block or STEPS_ASSUMED)
    if block:
        steps = min(steps, block)
    width = block or 1  # positions per pass, per generated token when the block is unknown
    sequences, tokens = 1, int(params.get("max_new_tokens") or settings.limits.default_max_new_tokens)
    if kind == JobKind.DECIDE:
        questions = max(1, len((input or {}).get("questions") or ()))
        tokens = decide_tokens_per_question(input or {}, settings)
        if (input or {}).get("mode", params.get("mode")) == "joint":
            tokens *= questions  # one sequence holds every question
        else:
            sequences = questions  # one sequence per question
    elif kind == JobKind.EXTRACT:
        tokens = extract_tokens(input or {}, settings)
    cost = sequences * math.ceil(tokens / width) * steps * width
    budget = params.get("step_budget")
    if budget is not None:  # at most ``budget`` passes of ``block`` positions (assumed when unknown)
        cost = min(cost, int(budget) * (block or BUDGET_BLOCK_ASSUMED))
    return cost + max(0, prompt_tokens) * settings.scheduling.prefill_token_cost


def decide_tokens_per_question(input: Mapping[str, Any], settings: Settings) -> int:
    """Generated tokens per question of a decision: the JSON answer object (~16 tokens with
    its choice) plus the rationale slot when asked for."""
    rationale = settings.decisions.rationale_tokens + 8 if input.get("rationale") else 0
    return 16 + rationale


def extract_tokens(input: Mapping[str, Any], settings: Settings) -> int:
    """Generated tokens of an extract job: its schema's canvas, estimated. The schema was checked
    at submit; should it not parse here (limits lowered since), ``default_max_new_tokens``."""
    try:
        schema = json.dumps(input.get("schema"), sort_keys=True)
    except (TypeError, ValueError):
        return settings.limits.default_max_new_tokens
    return _schema_tokens(schema, parse_options(settings)) or settings.limits.default_max_new_tokens


@functools.lru_cache(maxsize=256)
def _schema_tokens(schema_json: str, options: ParseOptions) -> int | None:
    """The estimate by the schema's JSON: a pipeline sends one schema with many documents, and the
    parse (the meta-schema check above all, ~2 ms) would otherwise run on every route."""
    try:
        return estimate_canvas_tokens(parse_schema(json.loads(schema_json), options))
    except SchemaError:
        return None


def class_for_cost(cost: int, settings: Settings) -> QueueName:
    if cost <= settings.scheduling.interactive_max_cost:
        return QueueName.INTERACTIVE
    if cost <= settings.scheduling.standard_max_cost:
        return QueueName.STANDARD
    return QueueName.BULK


def route_job(
    *,
    kind: str,
    input: Mapping[str, Any] | None,
    params: Mapping[str, Any],
    priority: str | None,
    settings: Settings,
    prompt_tokens: int = 0,
) -> Route:
    """The cost, class and queue of a new job (``prompt_tokens``: see ``estimate_cost``)."""
    cost = estimate_cost(kind=kind, input=input, params=params, settings=settings,
                         prompt_tokens=prompt_tokens)
    earned = class_for_cost(cost, settings)
    requested = parse_priority(priority)
    cls = max(earned, requested, key=lambda q: q.rank) if requested else earned
    if kind == JobKind.DECIDE and (input or {}).get("mode", params.get("mode")) == "joint":
        return Route(cost=cost, priority=cls, queue=QueueName.JOINT)
    return Route(cost=cost, priority=cls, queue=cls)


def deadline_seconds(queue: str, settings: Settings, params: Mapping[str, Any] | None = None) -> float:
    """Max run time of one attempt for jobs of ``queue`` (thinking jobs get their own, longer one)."""
    jobs = settings.jobs
    base = jobs.joint_deadline_seconds if queue == QueueName.JOINT else jobs.deadline_seconds
    if params and params.get("thinking"):
        return max(base, settings.thinking.deadline_seconds)
    return base
