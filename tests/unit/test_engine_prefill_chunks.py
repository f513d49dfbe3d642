"""Chunked prefill (worker/engine/prefill_chunks.py): the plan against a plain reference, the same
tokens as an unchunked prefill on every family (greedy and seeded; chunks of 1, 2 and 7 blocks;
with and without the prefix cache), and a short job that no longer waits for a long prompt."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.engine.engine import Engine, EngineConfig
from worker.engine.prefill_chunks import plan_prefill
from worker.engine.types import GenerationRequest, SamplingParams
from worker.model.checkpoint import LoadedModel, load_checkpoint

BIG = 1 << 30


def reference_plan(pending: list[int], blocks: list[int], budget: int) -> tuple[list[bool], list[int]]:
    """The rule as prose says it, written the plain way (one row at a time, no shortcuts)."""
    if budget <= 0:
        return [True] * len(pending), [0] * len(pending)
    joins, chunks, left, moved = [], [], budget, False
    for tokens, block in zip(pending, blocks, strict=True):
        if tokens <= block or tokens <= left:  # decoding rows always; prompts that fit
            joins.append(True)
            chunks.append(0)
            left -= tokens
        else:
            whole_blocks = max(left, 0) // block
            if whole_blocks == 0 and not moved:
                whole_blocks = 1
            chunk = min(whole_blocks * block, tokens)
            joins.append(False)
            chunks.append(chunk)
            left -= chunk
            moved = moved or chunk > 0
    return joins, chunks


@pytest.mark.parametrize(("pending", "blocks", "budget"), [
    ([4, 4, 4], [4, 4, 4], 8),  # decoding rows join even past the budget
    ([4, 400, 4], [4, 4, 4], 64),  # the long prompt prefills 60 (what is left), joins later
    ([400, 400], [4, 4], 64),  # the second prompt waits: the budget went to the first
    ([4] * 20 + [400], [4] * 21, 16),  # budget spent by decoding rows: the prompt still moves a block
    ([32, 400, 12], [8, 8, 4], 40),  # a prompt that fits joins; block sizes differ
    ([400, 400], [4, 4], 0),  # off
    ([400, 8], [8, 8], 4),  # a budget below one block
])
def test_plan_matches_the_reference(pending: list[int], blocks: list[int], budget: int) -> None:
    plan = plan_prefill(pending, blocks, budget)
    assert (plan.joins, plan.chunks) == reference_plan(pending, blocks, budget)
    if budget > 0:  # a long prompt always advances; chunks are whole blocks
        assert all(c % b == 0 for c, b in zip(plan.chunks, blocks, strict=True))
        assert any(plan.chunks) or all(plan.joins)


def test_plan_examples() -> None:
    plan = plan_prefill([4, 400, 4], [4, 4, 4], 64)
    assert plan.joins == [True, False, True] and plan.chunks == [0, 60, 0]
    assert plan_prefill([4] * 20 + [400], [4] * 21, 16).chunks[-1] == 4


@pytest.fixture(scope="module")
def tiny(family_checkpoint: Path) -> LoadedModel:
    return load_checkpoint(family_checkpoint)


def _engine(lm: LoadedModel, *, chunk_tokens: int, prefix_bytes: int = 0, max_batch: int = 4) -> Engine:
    engine = Engine(
        lm.model,
        EngineConfig(max_batch=max_batch, max_len=384, prefix_cache_bytes=prefix_bytes,
                     prefill_chunk_tokens=chunk_tokens),
        mask_token_id=lm.config.mask_token_id,
        eos_token_ids=(),  # random weights: decode the whole region every time
        default_block_size=lm.config.block_size,
    )
    engine.start()
    return engine


@pytest.fixture(scope="module")
def unchunked(tiny: LoadedModel) -> Iterator[Engine]:
    engine = _engine(tiny, chunk_tokens=0)
    yield engine
    engine.stop()


def _requests(lm: LoadedModel, seeded: bool) -> list[GenerationRequest]:
    """Prompts of 5 to 29 whole blocks sharing a 70-token document (the prefix cache's case)."""
    vocab, mask = lm.config.vocab_size, lm.config.mask_token_id
    doc = [(13 * j + 5) % vocab for j in range(70)]
    requests = []
    for i, extra in enumerate((0, 23, 47)):
        tail = [(7 * i + 3 * j + 101) % vocab for j in range(extra)]
        prompt = [t if t != mask else t + 1 for t in doc + tail]
        params = (SamplingParams(max_new_tokens=8, temperature=0.9, top_k=20, seed=40 + i) if seeded
                  else SamplingParams(max_new_tokens=8))
        requests.append(GenerationRequest(f"r{i}", prompt, params))
    return requests


@pytest.mark.parametrize(("blocks_per_chunk", "seeded"), [(1, False), (2, False), (7, False), (2, True)],
                         ids=["1-greedy", "2-greedy", "7-greedy", "2-seeded"])
def test_chunked_prefill_gives_the_same_tokens(tiny: LoadedModel, unchunked: Engine, blocks_per_chunk: int,
                                               seeded: bool) -> None:
    """Each request alone (so only the chunking differs), then all three together, chunked, with
    and without the prefix cache, against the unchunked engine's tokens."""
    requests = _requests(tiny, seeded)
    expected = [unchunked.submit(r).result(timeout=120).token_ids for r in requests]
    budget = blocks_per_chunk * tiny.config.block_size
    for prefix_bytes in (0, BIG):
        engine = _engine(tiny, chunk_tokens=budget, prefix_bytes=prefix_bytes)
        try:
            alone = [engine.submit(r).result(timeout=120).token_ids for r in requests]
            together = [f.result(timeout=120).token_ids for f in engine.submit_many(_requests(tiny, seeded))]
            stats = engine.stats()
        finally:
            engine.stop()
        assert alone == expected, f"alone, prefix cache {bool(prefix_bytes)}"
        assert together == expected, f"together, prefix cache {bool(prefix_bytes)}"
        assert stats.prefill_chunks > 0


def test_a_short_job_does_not_wait_for_a_long_prefill(tiny: LoadedModel) -> None:
    """A 300-token prompt prefills one block per iteration; an 8-token job submitted right after
    it finishes first (unchunked, it would wait for the whole prompt's forward in its first pass)."""
    block = tiny.config.block_size
    engine = _engine(tiny, chunk_tokens=block)
    try:
        prompt = [(3 * j) % 400 + 1 for j in range(300)]
        long = GenerationRequest("long", prompt, SamplingParams(max_new_tokens=4))
        short = GenerationRequest("short", [5, 6, 7], SamplingParams(max_new_tokens=8))
        long_future = engine.submit(long)
        short_result = engine.submit(short).result(timeout=120)
        assert not long_future.done(), "the short job finished after the long prompt's prefill"
        long_result = long_future.result(timeout=120)
        stats = engine.stats()
    finally:
        engine.stop()
    assert len(short_result.token_ids) == 8 and len(long_result.token_ids) == 4
    assert stats.prefill_chunks >= 300 // block - 1
