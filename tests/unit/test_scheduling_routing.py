"""Routing rules: cost estimate, class thresholds, client priority may only lower, joint queue."""

from __future__ import annotations

import random

import pytest

from scheduler.infra.settings import Settings
from scheduler.jobs.models import QueueName
from scheduler.jobs.retry import backoff_seconds
from scheduler.jobs.routing import (
    InvalidPriorityError,
    class_for_cost,
    estimate_cost,
    parse_priority,
    route_job,
)

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


def _plain_job_backoff(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """The jobs' retry delay as written before issue 30 (equal jitter)."""
    delay = min(cap, base * 2 ** max(0, attempt - 1))
    return delay / 2 + rng.uniform(0, delay / 2)


def _plain_webhook_backoff(attempts: int, base: float, cap: float, rng: random.Random) -> float:
    """The webhooks' delay as written before issue 30 (x1-1.25 jitter)."""
    return min(cap, base * (2 ** max(0, attempts - 1))) * rng.uniform(1.0, 1.25)


@pytest.mark.parametrize(("base", "cap"), [(2.0, 300.0), (1.0, 10.0), (0.2, 0.5), (0.0, 5.0)])
def test_one_backoff_serves_jobs_and_webhooks(base: float, cap: float) -> None:
    """Issue 30: ``exponential_backoff`` with either jitter gives, draw for draw on the same seed, what
    each of the two former copies gave; the jobs' and the webhooks' wrappers read their own settings."""
    from scheduler.jobs.retry import EQUAL_JITTER, LATE_JITTER, exponential_backoff
    from scheduler.webhooks import delivery

    checked = 0
    for jitter, plain in ((EQUAL_JITTER, _plain_job_backoff), (LATE_JITTER, _plain_webhook_backoff)):
        ours, theirs = random.Random(7), random.Random(7)
        for attempt in range(0, 12):
            got = exponential_backoff(attempt, base_seconds=base, max_seconds=cap, jitter=jitter, rng=ours)
            assert got == pytest.approx(plain(attempt, base, cap, theirs), rel=1e-12, abs=1e-15)
            checked += 1
    assert checked == 24
    settings = Settings(retry_backoff_base_seconds=base, retry_backoff_max_seconds=cap,
                        webhook_backoff_base_seconds=base, webhook_backoff_max_seconds=cap)  # fmt: skip
    ours, theirs = random.Random(3), random.Random(3)
    assert backoff_seconds(4, settings, rng=ours) == pytest.approx(_plain_job_backoff(4, base, cap, theirs))
    state = random.getstate()
    try:
        random.seed(5)
        got = delivery.webhook_backoff_seconds(4, settings)  # the module's generator, as before
        assert got == pytest.approx(_plain_webhook_backoff(4, base, cap, random.Random(5)))
    finally:
        random.setstate(state)


def test_cost_counts_every_position_of_every_pass() -> None:
    """One generated token in a block of 1024 with 64 steps is 64 passes over 1024 positions."""
    settings = Settings()  # the deployment's real thresholds
    params = {"max_new_tokens": 1, "block_size": 1024, "steps_per_block": 64}
    assert estimate_cost(kind="generate", input={}, params=params, settings=settings) == 1024 * 64
    route = route_job(kind="generate", input={}, params=params, priority=None, settings=settings)
    assert route.queue is not QueueName.INTERACTIVE
    # blocks x block size x steps: 10 tokens in blocks of 4 are 3 blocks of 4 positions
    params = {"max_new_tokens": 10, "block_size": 4, "steps_per_block": 2}
    assert estimate_cost(kind="generate", input={}, params=params, settings=SETTINGS) == 3 * 4 * 2
    short = {"max_new_tokens": 16, "block_size": 4, "steps_per_block": 4}
    assert route_job(kind="generate", input={}, params=short, priority=None, settings=settings).queue \
        is QueueName.INTERACTIVE


def test_steps_above_the_block_size_count_as_the_block_size() -> None:
    # The API refuses such requests; a stored row still gets the most passes a block can take.
    over = {"max_new_tokens": 8, "block_size": 4, "steps_per_block": 64}
    exact = {"max_new_tokens": 8, "block_size": 4, "steps_per_block": 4}
    assert estimate_cost(kind="generate", input={}, params=over, settings=SETTINGS) \
        == estimate_cost(kind="generate", input={}, params=exact, settings=SETTINGS) == 2 * 4 * 4


def test_a_step_budget_caps_passes_of_the_block_size() -> None:
    params = {"max_new_tokens": 1, "block_size": 1024, "steps_per_block": 64, "step_budget": 2}
    assert estimate_cost(kind="generate", input={}, params=params, settings=SETTINGS) == 2 * 1024
    # without a block size the budget's passes are counted at the assumed positions per pass
    params = {"max_new_tokens": 512, "steps_per_block": 4, "step_budget": 8}
    assert estimate_cost(kind="generate", input={}, params=params, settings=SETTINGS) == 8 * 4


def test_decision_cost_is_per_question_in_the_block_geometry() -> None:
    questions = {"questions": [{}] * 3}
    params = {"block_size": 32, "steps_per_block": 8}
    per_question = 1 * 32 * 8  # 16 answer tokens fit one block of 32
    assert estimate_cost(kind="decide", input=questions, params=params, settings=SETTINGS) == 3 * per_question
    joint = estimate_cost(kind="decide", input={**questions, "mode": "joint"}, params=params,
                          settings=SETTINGS)
    assert joint == 2 * 32 * 8  # 48 tokens of one sequence: 2 blocks
    big = {"block_size": 1024, "steps_per_block": 64}
    route = route_job(kind="decide", input={"questions": [{}]}, params=big, priority=None,
                      settings=Settings())
    assert route.queue is not QueueName.INTERACTIVE
