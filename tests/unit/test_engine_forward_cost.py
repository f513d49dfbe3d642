"""The forward cost model and its measurement (worker/engine/forward_cost.py) against plain
references: the chunk that fits is found by counting, and the fit recovers a known ``W`` from
forward times made by that model (with noise)."""

from __future__ import annotations

import random

import pytest

from worker.engine.forward_cost import DEFAULT_TOKEN_WORK_KEYS, ForwardCost, TokenWorkFit


@pytest.mark.parametrize("token_keys", [64, 4096, 36000])
def test_tokens_within_is_the_largest_whole_block_chunk(token_keys: int) -> None:
    cost = ForwardCost(token_keys)
    rng = random.Random(token_keys)
    for _ in range(300):
        context, block = rng.randrange(0, 40000), rng.choice([1, 4, 32])
        work = rng.randrange(0, 4000) * (context + token_keys)
        tokens = 0
        while cost.work(tokens + block, context) <= work:  # the plain way: count up block by block
            tokens += block
        assert cost.tokens_within(work, context, block) == tokens


def _time(tokens: int, context: int, *, per_key: float, token_keys: int, noise: float,
          rng: random.Random) -> float:
    return per_key * tokens * (context + tokens + token_keys) * (1 + rng.uniform(-noise, noise))


def test_the_fit_recovers_w_from_chunk_times() -> None:
    """512-token chunks down a 16K-token prompt, 5% timing noise, W = 6,600 (the tiny demo's)."""
    rng, fit = random.Random(0), TokenWorkFit()
    assert fit.token_keys() is None
    for start in range(0, 16384, 512):
        fit.observe(512, start, _time(512, start, per_key=5.4e-9, token_keys=6600, noise=0.05, rng=rng))
    measured = fit.token_keys()
    assert measured is not None and abs(measured - 6600) < 0.15 * 6600


def test_the_fit_waits_for_forwards_that_can_tell() -> None:
    """Forwards at one depth cannot separate per-token from per-key work: no figure yet."""
    rng, fit = random.Random(1), TokenWorkFit()
    for _ in range(20):
        fit.observe(64, 100, _time(64, 100, per_key=1e-8, token_keys=4096, noise=0.02, rng=rng))
    assert fit.token_keys() is None
    fit.observe(0, 0, 1.0)  # nothing fed: ignored
    fit.observe(64, 0, -1.0)  # a clock that went backwards: ignored
    assert fit.token_keys() is None


def test_the_fit_follows_the_machine() -> None:
    """Older forwards decay: some 160 forwards after the cost changed, the figure is the new one."""
    rng, fit = random.Random(2), TokenWorkFit()
    for token_keys in (2000, 20000):
        for _ in range(10):
            for start in range(0, 8192, 512):
                fit.observe(512, start, _time(512, start, per_key=1e-8, token_keys=token_keys, noise=0.0,
                                              rng=rng))
    measured = fit.token_keys()
    assert measured is not None and abs(measured - 20000) < 0.2 * 20000
    assert ForwardCost().token_keys == DEFAULT_TOKEN_WORK_KEYS


def test_the_fit_separates_a_forwards_fixed_cost() -> None:
    """The tiny CPU demo's shape (measured: 3.8 ms per forward, 17 us per token, 5.5 ns per token
    and key, so W ~ 3,100): chunks cut as the engine cuts them (their sizes vary with depth), 3%
    noise. Without the intercept the fixed cost would count as per-token work (W ~ 4,500)."""
    rng, fit, cost = random.Random(3), TokenWorkFit(), ForwardCost(3100)
    at, budget = 0, cost.work(512, 0)
    while at < 16384:
        tokens = max(cost.tokens_within(budget, at, 4), 4)
        seconds = (3.8e-3 + 17e-6 * tokens + 5.5e-9 * tokens * (at + tokens)) * (1 + rng.uniform(-0.03, 0.03))
        fit.observe(tokens, at, seconds)
        at += tokens
    measured = fit.token_keys()
    assert measured is not None and abs(measured - 3100) < 0.15 * 3100
