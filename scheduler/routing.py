"""Cost estimate, priority class and queue of a job: short requests first, nobody starves.

Cost = generated tokens x denoising steps per block (x questions for decisions): the number of
token-predictions the engine will make, which is what occupies a batch slot. Cheap jobs go to
``interactive``, mid-sized to ``standard``, the rest to ``bulk``; joint-mode decisions go to
their own ``joint`` queue (own workers, own deadline, capped engine slots).

A client may ask for a *lower* class than its cost earns (e.g. batch work it does not want to
compete with interactive traffic) but never a higher one. Starvation is bounded by aging: the
beat task ``promote_aged_jobs`` moves any job queued longer than ``aging_seconds`` into
``interactive`` (see ``scheduler/maintenance.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scheduler.models import JobKind, QueueName
from scheduler.settings import Settings

# Classes a client may name in ``priority``; ranks follow QueueName order.
PRIORITY_CLASSES: tuple[QueueName, ...] = (QueueName.INTERACTIVE, QueueName.STANDARD, QueueName.BULK)
# Friendly aliases accepted for ``priority``.
PRIORITY_ALIASES: Mapping[str, QueueName] = {
    "high": QueueName.INTERACTIVE,
    "normal": QueueName.STANDARD,
    "low": QueueName.BULK,
}


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
    *, kind: str, input: Mapping[str, Any] | None, params: Mapping[str, Any], settings: Settings
) -> int:
    """Tokens x steps (x questions): an upper bound of token-predictions for the job."""
    max_new = int(params.get("max_new_tokens") or settings.default_max_new_tokens)
    steps = int(params.get("steps_per_block") or settings.default_steps_per_block)
    block = int(params.get("block_size") or 4)
    budget = params.get("step_budget")
    if budget:
        blocks = max(1, math.ceil(max_new / max(1, block)))
        steps = max(1, min(steps, int(budget) // blocks or 1))
    questions = 1
    if kind == JobKind.DECIDE and input:
        questions = max(1, len(input.get("questions") or ()) or 1)
        max_new = decide_tokens_per_question(input, settings)
        blocks = max(1, math.ceil(max_new * questions / max(1, block)))
        if budget:
            steps = max(1, min(int(params.get("steps_per_block") or settings.default_steps_per_block),
                               int(budget) // blocks or 1))
    return max_new * steps * questions


def decide_tokens_per_question(input: Mapping[str, Any], settings: Settings) -> int:
    """Generated tokens per question of a decision: the JSON answer object (~16 tokens with
    its choice) plus the rationale slot when asked for."""
    rationale = settings.decide_rationale_tokens + 8 if input.get("rationale") else 0
    return 16 + rationale


def class_for_cost(cost: int, settings: Settings) -> QueueName:
    if cost <= settings.interactive_max_cost:
        return QueueName.INTERACTIVE
    if cost <= settings.standard_max_cost:
        return QueueName.STANDARD
    return QueueName.BULK


def route_job(
    *,
    kind: str,
    input: Mapping[str, Any] | None,
    params: Mapping[str, Any],
    priority: str | None,
    settings: Settings,
) -> Route:
    """The cost, class and queue of a new job."""
    cost = estimate_cost(kind=kind, input=input, params=params, settings=settings)
    earned = class_for_cost(cost, settings)
    requested = parse_priority(priority)
    cls = max(earned, requested, key=lambda q: q.rank) if requested else earned
    if kind == JobKind.DECIDE and (input or {}).get("mode", params.get("mode")) == "joint":
        return Route(cost=cost, priority=cls, queue=QueueName.JOINT)
    return Route(cost=cost, priority=cls, queue=cls)


def deadline_seconds(queue: str, settings: Settings, params: Mapping[str, Any] | None = None) -> float:
    """Max run time of one attempt for jobs of ``queue`` (thinking jobs get their own, longer one)."""
    base = settings.joint_deadline_seconds if queue == QueueName.JOINT else settings.job_deadline_seconds
    if params and params.get("thinking"):
        return max(base, settings.thinking_deadline_seconds)
    return base
