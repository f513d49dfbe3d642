"""Routing rules: cost estimate, class thresholds, client priority may only lower, joint queue."""

from __future__ import annotations

import random

import pytest

from scheduler.models import QueueName
from scheduler.retry import backoff_seconds
from scheduler.routing import InvalidPriorityError, class_for_cost, estimate_cost, parse_priority, route_job
from scheduler.settings import Settings

SETTINGS = Settings(interactive_max_cost=1000, standard_max_cost=10_000, default_max_new_tokens=128,
                    default_steps_per_block=4)


def test_cost_is_tokens_times_steps_with_defaults() -> None:
    assert estimate_cost(kind="generate", input={}, params={}, settings=SETTINGS) == 128 * 4
    assert estimate_cost(kind="generate", input={}, params={"max_new_tokens": 10, "steps_per_block": 3},
                         settings=SETTINGS) == 30


def test_a_tight_step_budget_lowers_the_cost() -> None:
    # 64 tokens in blocks of 4 = 16 blocks; a budget of 32 passes affords 2 steps per block.
    params = {"max_new_tokens": 64, "steps_per_block": 8, "block_size": 4, "step_budget": 32}
    assert estimate_cost(kind="generate", input={}, params=params, settings=SETTINGS) == 64 * 2


def test_decisions_cost_scales_with_questions() -> None:
    params = {"max_new_tokens": 10, "steps_per_block": 2}
    one = estimate_cost(kind="decide", input={"questions": [{}]}, params=params, settings=SETTINGS)
    five = estimate_cost(kind="decide", input={"questions": [{}] * 5}, params=params, settings=SETTINGS)
    assert five == 5 * one > 0


@pytest.mark.parametrize(("cost", "expected"), [
    (1, QueueName.INTERACTIVE), (1000, QueueName.INTERACTIVE), (1001, QueueName.STANDARD),
    (10_000, QueueName.STANDARD), (10_001, QueueName.BULK),
])
def test_class_thresholds(cost: int, expected: QueueName) -> None:
    assert class_for_cost(cost, SETTINGS) is expected


def test_client_priority_may_lower_but_never_raise() -> None:
    short = {"max_new_tokens": 10, "steps_per_block": 2}
    long = {"max_new_tokens": 1000, "steps_per_block": 64}
    lowered = route_job(kind="generate", input={}, params=short, priority="bulk", settings=SETTINGS)
    assert lowered.queue is QueueName.BULK
    raised = route_job(kind="generate", input={}, params=long, priority="interactive", settings=SETTINGS)
    assert raised.queue is QueueName.BULK
    assert route_job(kind="generate", input={}, params=short, priority="low", settings=SETTINGS).queue \
        is QueueName.BULK
    assert route_job(kind="generate", input={}, params=short, priority=None, settings=SETTINGS).queue \
        is QueueName.INTERACTIVE


def test_joint_decisions_have_their_own_queue() -> None:
    route = route_job(kind="decide", input={"questions": [{}]}, params={"mode": "joint"}, priority=None,
                      settings=SETTINGS)
    assert route.queue is QueueName.JOINT
    assert route.priority in (QueueName.INTERACTIVE, QueueName.STANDARD, QueueName.BULK)


@pytest.mark.parametrize("bad", ["urgent", "joint", ""])
def test_unknown_or_reserved_priorities_are_rejected(bad: str) -> None:
    with pytest.raises(InvalidPriorityError):
        parse_priority(bad)


def test_backoff_grows_exponentially_with_bounded_jitter() -> None:
    settings = Settings(retry_backoff_base_seconds=2.0, retry_backoff_max_seconds=30.0)
    rng = random.Random(0)
    for attempt, base in [(1, 2.0), (2, 4.0), (3, 8.0), (4, 16.0), (5, 30.0), (9, 30.0)]:
        delays = [backoff_seconds(attempt, settings, rng=rng) for _ in range(200)]
        assert all(base / 2 <= d <= base for d in delays)
        assert max(delays) - min(delays) > base / 4  # jitter actually spreads retries
