"""The forward cost model and its measurement (worker/engine/forward_cost.py, the runner's
calibration) against plain references: the chunk that fits is found by counting; the fit
recovers a known ``W`` from the calibration's forwards timed by that model with noise, and gives
no wild figure where noise hides attention; a real engine measures a figure at its first chunk,
and only when chunked prefill needs it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from worker.engine.engine import Engine, EngineConfig
from worker.engine.forward_cost import (
    CALIBRATION_REPEATS,
    DEFAULT_TOKEN_WORK_KEYS,
    ForwardCost,
    fit_token_keys,
)
from worker.engine.types import GenerationRequest, SamplingParams
from worker.model.checkpoint import load_checkpoint


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


def _calibration(*, fixed: float, per_token: float, per_key: float, noise: float, depth: int,
                 rng: random.Random) -> list[tuple[int, int, float]]:
    """The runner's calibration forwards (512 and 64 tokens at context 0 and ``depth``,
    ``CALIBRATION_REPEATS`` times each) timed by ``fixed + per_token T + per_key T (S)``, with
    uniform relative noise."""
    samples = []
    for context in (0, depth):
        for _ in range(CALIBRATION_REPEATS):
            for tokens in (64, 512):
                seconds = fixed + per_token * tokens + per_key * tokens * (context + tokens)
                samples.append((tokens, context, seconds * (1 + rng.uniform(-noise, noise))))
    return samples


def test_the_fit_recovers_the_tiny_demos_w() -> None:
    """The tiny CPU demo's shape (measured: 3.8 ms per forward, 17 us per token, 5.5 ns per token
    and key, so W ~ 3,100), 5% noise, in 20 seeded calibrations: within 20% every time. Without
    the intercept the fixed cost would count as per-token work (W ~ 4,500)."""
    for seed in range(20):
        samples = _calibration(fixed=3.8e-3, per_token=17e-6, per_key=5.5e-9, noise=0.05, depth=8192,
                               rng=random.Random(seed))
        measured = fit_token_keys(samples)
        assert measured is not None and abs(measured - 3100) < 0.2 * 3100, (seed, measured)


def test_noise_that_hides_attention_keeps_chunks_whole() -> None:
    """A host-bound GPU-like forward (20 ms fixed, W = 40,000) with 5% noise, 20 seeds: at depth 8,192
    attention is ~2% of a forward, under the noise. The figure then never falls far below the
    truth (a plain a / c ranged from the bottom clamp to the top one on such data): smaller chunks
    would each pay the 20 ms."""
    for seed in range(20):
        samples = _calibration(fixed=20e-3, per_token=4e-6, per_key=1e-10, noise=0.05, depth=8192,
                               rng=random.Random(seed))
        measured = fit_token_keys(samples)
        assert measured is None or measured > 40000 / 1.5, (seed, measured)


def test_the_fit_declines_what_it_cannot_tell() -> None:
    one_size = [(512, context, 1e-3 + 1e-8 * 512 * (context + 512))
                for context in (0, 8192) for _ in range(3)]
    assert fit_token_keys(one_size) is None  # the intercept and the per-token work are one column
    assert fit_token_keys(one_size[:4]) is None  # too few
    no_token_work = [(t, s, 1e-3 + 1e-9 * t * (s + t)) for t in (64, 512) for s in (0, 8192)] * 2
    assert fit_token_keys(no_token_work) in (None, DEFAULT_TOKEN_WORK_KEYS // 4)


def test_a_measured_figure_is_clamped() -> None:
    """Per-key work dominating (W ~ 10): the figure stops at a quarter of the default, where deep
    chunks would otherwise shrink to single blocks that each pay a forward's fixed cost."""
    samples = _calibration(fixed=1e-3, per_token=1e-8, per_key=1e-9, noise=0.0, depth=8192,
                           rng=random.Random(0))
    assert fit_token_keys(samples) == DEFAULT_TOKEN_WORK_KEYS // 4


def test_an_engine_measures_w_at_its_first_chunk(family_checkpoint: Path) -> None:
    """A real engine on a demo checkpoint measures ``W`` in its own thread before the first
    iteration that prefills a chunk, not before (a short prompt does not trigger it); the figure
    is any the machine's timing gives. With the operator's figure, or with chunking off, nothing
    is measured."""
    lm = load_checkpoint(family_checkpoint)
    mask = lm.config.mask_token_id
    assert mask is not None

    def engine(**config: int) -> Engine:
        return Engine(lm.model, EngineConfig(max_batch=2, max_len=2048, **config), mask_token_id=mask,
                      eos_token_ids=(), default_block_size=lm.config.block_size)

    def prompt(tokens: int) -> list[int]:
        ids = ((7 * j + 3) % lm.config.vocab_size for j in range(tokens))
        return [t if t != mask else t + 1 for t in ids]

    measuring = engine(prefill_chunk_tokens=256)
    measuring.start()
    try:
        for tokens in (40, 700):
            request = GenerationRequest(f"p{tokens}", prompt(tokens), SamplingParams(max_new_tokens=4))
            measuring.submit(request).result(timeout=120)
            # a prompt within the budget: nothing to chunk, nothing measured; a longer one: measured
            assert measuring._calibrated == (tokens > 256)
    finally:
        measuring.stop()
    measuring.cache.free(measuring.cache.allocate())  # the calibration gave its slot back
    fixed = engine(prefill_chunk_tokens=256, token_work_keys=9000)
    assert fixed.calibrate() is None and fixed.runner.forward_cost.token_keys == 9000
    off = engine(prefill_chunk_tokens=0)
    assert off.calibrate() is None and off.runner.forward_cost.token_keys == DEFAULT_TOKEN_WORK_KEYS
