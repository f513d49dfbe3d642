"""Chunked prefill (worker/engine/prefill_chunks.py): the plan against a plain reference, the same
tokens as an unchunked prefill on every family (greedy and seeded; chunks of 1, 2 and 7 blocks;
with and without the prefix cache), and a short job that no longer waits for a long prompt."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from worker.engine.engine import Engine, EngineConfig
from worker.engine.forward_cost import ForwardCost
from worker.engine.prefill_chunks import chunk_spans, join_rows, plan_prefill
from worker.engine.runner import PassTimings, RowOutcome, RowSpec
from worker.engine.types import GenerationRequest, SamplingParams
from worker.model.checkpoint import LoadedModel, load_checkpoint

BIG = 1 << 30
W = 4096  # the cost model's per-token work in the plan tests (forward_cost.py)
COST = ForwardCost(W)


def work(tokens: int, context: int) -> int:
    return tokens * (context + tokens + W)


def most_blocks(left: int, context: int, block: int) -> int:
    """The largest whole-block chunk within ``left`` work, by counting up (no algebra)."""
    tokens = 0
    while work(tokens + block, context) <= left:
        tokens += block
    return tokens


def reference_plan(pending: list[int], contexts: list[int], blocks: list[int],
                   budget: int) -> tuple[list[bool], list[int]]:
    """The rule as prose says it, written the plain way (one row at a time, no shortcuts)."""
    n = len(pending)
    if budget <= 0:
        return [True] * n, [0] * n
    joins, chunks, left = [False] * n, [0] * n, work(budget, 0)
    for i in range(n):  # decoding rows always join, even past the budget, charged as at context 0
        if pending[i] <= blocks[i]:
            joins[i] = True
            left -= work(pending[i], 0)
    for i in range(n):  # then whole prompts that fit, oldest first
        if not joins[i] and work(pending[i], contexts[i]) <= left:
            joins[i] = True
            left -= work(pending[i], contexts[i])
    moved = False
    for i in range(n):  # then chunks of whole blocks; the oldest prompt left moves at least a block
        if joins[i]:
            continue
        chunk = most_blocks(left, contexts[i], blocks[i])
        if chunk == 0 and not moved:
            chunk = blocks[i]
        chunks[i] = min(chunk, pending[i])
        left -= work(chunks[i], contexts[i]) if chunks[i] else 0
        moved = moved or chunks[i] > 0
    return joins, chunks


@pytest.mark.parametrize(("pending", "contexts", "blocks", "budget"), [
    ([4, 4, 4], [8, 8, 8], [4, 4, 4], 8),  # decoding rows join even past the budget
    ([4, 400, 4], [8, 0, 8], [4, 4, 4], 64),  # the long prompt prefills what is left, joins later
    ([400, 12, 4], [0, 0, 8], [4, 4, 4], 64),  # a short prompt goes ahead of an older long one
    ([400, 100, 12], [0, 0, 0], [4, 4, 4], 64),  # ... and of a younger one that does not fit
    ([400, 400], [0, 0], [4, 4], 64),  # the second prompt waits: the budget went to the first
    ([4] * 20 + [400], [8] * 20 + [0], [4] * 21, 16),  # budget spent: the prompt still moves a block
    ([32, 400, 12], [0, 0, 0], [8, 8, 4], 40),  # a prompt that fits joins; block sizes differ
    ([400, 400], [0, 0], [4, 4], 0),  # off
    ([400, 8], [0, 0], [8, 8], 4),  # a budget below one block
    ([8192, 4], [8192, 100], [4, 4], 512),  # deep into a long prompt a chunk carries fewer tokens
    ([4, 8192, 8192], [16000, 0, 8000], [4, 4, 4], 512),  # a deep decoding row: charged as at 0
    ([4] * 6 + [8], [100000] * 6 + [0], [4] * 7, 64),  # deep decoders do not starve a short prompt
])
def test_plan_matches_the_reference(pending: list[int], contexts: list[int], blocks: list[int],
                                    budget: int) -> None:
    plan = plan_prefill(pending, contexts, blocks, budget, COST)
    assert (plan.joins, plan.chunks) == reference_plan(pending, contexts, blocks, budget)
    if budget > 0:  # a long prompt always advances; chunks are whole blocks
        assert all(c % b == 0 for c, b in zip(plan.chunks, blocks, strict=True))
        assert any(plan.chunks) or all(plan.joins)
        # the chunks stay within what the pass left, but for the one block a prompt always moves
        spent = sum(work(c, s) for c, s in zip(plan.chunks, contexts, strict=True))
        first = next((i for i, c in enumerate(plan.chunks) if c), None)
        assert spent <= max(plan.left, 0) or (first is not None and plan.chunks[first] == blocks[first])


def test_plan_examples() -> None:
    plan = plan_prefill([4, 400, 4], [0, 0, 0], [4, 4, 4], 64, COST)
    assert plan.joins == [True, False, True] and plan.chunks == [0, 56, 0]  # never past the budget
    plan = plan_prefill([400, 12, 4], [0, 0, 0], [4, 4, 4], 64, COST)  # the short prompt joins first
    assert plan.joins == [False, True, True] and plan.chunks == [48, 0, 0]
    assert plan_prefill([4] * 20 + [400], [0] * 21, [4] * 21, 16, COST).chunks[-1] == 4
    plan = plan_prefill([4, 400, 4], [0, 0, 0], [4, 4, 4], 64, COST)
    assert plan.left == work(64, 0) - 2 * work(4, 0)
    assert sum(work(c, 0) for c in plan.chunks) <= plan.left  # what the chunks take from


def test_a_chunk_costs_the_budget_at_any_depth() -> None:
    """Issue 26: a 512-token chunk at a prompt's start and the chunks 8K and 15K tokens in cost
    the same work (to within one block), so a short job never waits for more than the budget's
    forward; counted in tokens, the deep chunk cost 2.9x the first on the tiny demo."""
    budget, block = 512, 4
    for context in (0, 8192, 15360):
        chunk = plan_prefill([16384], [context], [block], budget, COST).chunks[0]
        assert work(chunk, context) <= work(budget, 0) < work(chunk + block, context)
    assert plan_prefill([16384], [15360], [block], budget, COST).chunks[0] < budget // 2


def test_arrivals_between_forwards_share_what_is_left() -> None:
    # Two 416-token prompts arriving while a 448-token prompt's work is left: one joins, the other
    # waits for the next plan (each weighed against the whole rest, both joined: 832 tokens in one
    # forward).
    left = work(448, 0)
    assert join_rows([416, 416], [0, 0], [4, 4], left, COST) == ([True, False], left - work(416, 0))
    # One-block rows always join, even past a spent budget; prompts then only if they fit.
    assert join_rows([4, 12, 4], [0, 0, 0], [4, 4, 4], 0, COST) == ([True, False, True], -2 * work(4, 0))
    exact = work(12, 0) + work(8, 0) + work(4, 0)
    assert join_rows([12, 8, 4], [0, 0, 0], [4, 4, 4], exact, COST) == ([True, True, True], 0)


@pytest.mark.parametrize(("start", "end", "block", "budget", "spans"), [
    (0, 20, 4, 16, [(0, 16), (16, 20)]),  # whole blocks of the budget; the last is the rest
    (0, 20, 4, 8, [(0, 8), (8, 12), (12, 16), (16, 20)]),  # 8 tokens after 8 cost more than the first 8
    (8, 20, 4, 10, [(8, 16), (16, 20)]),  # the budget rounds down to whole blocks
    (0, 12, 4, 3, [(0, 4), (4, 8), (8, 12)]),  # a budget below one block still moves one
    (0, 20, 4, 0, [(0, 20)]),  # off: one span
    (8, 8, 4, 8, []),  # nothing to fill
    (0, 12288, 4, 4096, [(0, 4096), (4096, 7092), (7092, 9548), (9548, 11672), (11672, 12288)]),  # shrink
])
def test_work_sized_spans(start: int, end: int, block: int, budget: int,
                          spans: list[tuple[int, int]]) -> None:
    assert chunk_spans(start, end, block, budget, COST) == spans
    for at, to in spans[:-1]:  # each span but the last is the most the budget's work allows
        assert to - at == max(most_blocks(work(budget, 0), at, block), block)


@pytest.mark.parametrize(("start", "end", "block", "budget", "spans"), [
    (0, 20, 4, 8, [(0, 8), (8, 16), (16, 20)]),  # whole blocks of the budget; the last is the rest
    (8, 20, 4, 10, [(8, 16), (16, 20)]),  # the budget rounds down to whole blocks
    (0, 12, 4, 3, [(0, 4), (4, 8), (8, 12)]),  # a budget below one block still moves one
    (0, 20, 4, 0, [(0, 20)]),  # off: one span
    (8, 8, 4, 8, []),  # nothing to fill
    (0, 12288, 4, 4096, [(0, 4096), (4096, 8192), (8192, 12288)]),  # no shrinking: run back to back
])
def test_prefix_fill_spans(start: int, end: int, block: int, budget: int,
                           spans: list[tuple[int, int]]) -> None:
    """The prefix cache's fill (no cost model): spans of the budget's tokens."""
    assert chunk_spans(start, end, block, budget, None) == spans


@pytest.fixture(scope="module")
def tiny(family_checkpoint: Path) -> LoadedModel:
    return load_checkpoint(family_checkpoint)


def _engine(lm: LoadedModel, *, chunk_tokens: int, prefix_bytes: int = 0, max_batch: int = 4,
            token_work_keys: int = 0) -> Engine:
    engine = Engine(
        lm.model,
        EngineConfig(max_batch=max_batch, max_len=384, prefix_cache_bytes=prefix_bytes,
                     prefill_chunk_tokens=chunk_tokens, token_work_keys=token_work_keys),
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


def _record_forwards(engine: Engine, during: Callable[[str, int], None]) -> list[tuple[str, list[str]]]:
    """Wrap the engine's runner: each forward is logged as ("pass" | "chunk", request ids) in order,
    and ``during(kind, n)`` runs inside the ``n``-th forward of that kind (0-based), i.e. while it
    is running from the engine's point of view."""
    log: list[tuple[str, list[str]]] = []
    slots = {}  # slot -> request id, read from the engine's active rows
    counts = {"pass": 0, "chunk": 0}
    run_pass, run_prefill = engine.runner.run_pass, engine.runner.run_prefill

    def ids(slot_list: list[int]) -> list[str]:
        slots.update({a.slot: a.state.request.request_id for a in engine._active})
        return [slots[s] for s in slot_list]

    def pass_(rows: list[RowSpec], timings: PassTimings) -> list[RowOutcome]:
        log.append(("pass", ids([r.slot for r in rows])))
        during("pass", counts["pass"])
        counts["pass"] += 1
        return run_pass(rows, timings)

    def chunk(slot: int, tokens: list[int], start_pos: int, block_size: int, timings: PassTimings) -> None:
        log.append(("chunk", ids([slot])))
        during("chunk", counts["chunk"])
        counts["chunk"] += 1
        run_prefill(slot, tokens, start_pos, block_size, timings)

    engine.runner.run_pass = pass_  # type: ignore[method-assign]
    engine.runner.run_prefill = chunk  # type: ignore[method-assign]
    return log


@pytest.mark.parametrize("prompt_tokens", [5, 13], ids=["1-block-prompt", "3-block-prompt"])
@pytest.mark.parametrize("arrives_during", ["pass", "chunk"])
def test_a_short_job_waits_at_most_one_forward(tiny: LoadedModel, arrives_during: str,
                                               prompt_tokens: int) -> None:
    """Issue 26's bound, forward by forward: a short job that arrives while a long prompt's
    iteration runs a forward (its pass, or a chunk) has its first pass as the very next forward,
    never after a pass and a chunk, nor after the rest of the long prefill (a prompt of several
    blocks goes ahead of it). A short job decodes alongside to keep passes running."""
    block = tiny.config.block_size
    assert block is not None
    # 5 blocks: the 3-block prompt fits beside the decoding row at any of its depths (the budget is
    # work: a row decoding 60 positions in takes more of it than one at the start); a fixed W
    # keeps the schedule independent of the measured one
    engine = _engine(tiny, chunk_tokens=5 * block, token_work_keys=W)
    submitted: list[int] = []
    log: list[tuple[str, list[str]]] = []

    def during(kind: str, n: int) -> None:
        started = any("long" in ids for _, ids in log)
        if kind == arrives_during and started and not submitted and n >= 3:
            submitted.append(len(log))  # the index of the forward it arrived during
            late = [9 + j for j in range(prompt_tokens)]
            engine.submit(GenerationRequest("late", late, SamplingParams(max_new_tokens=8)))

    log = _record_forwards(engine, during)
    try:
        steady = engine.submit(GenerationRequest("steady", [5, 6, 7], SamplingParams(max_new_tokens=64)))
        prompt = [(3 * j) % 400 + 1 for j in range(200)]
        long = engine.submit(GenerationRequest("long", prompt, SamplingParams(max_new_tokens=4)))
        long.result(timeout=120)
        steady.result(timeout=120)
    finally:
        engine.stop()
    assert submitted, f"no {arrives_during} ran while the long prompt prefilled: {log}"
    arrived = submitted[0] - 1
    first = next(i for i, (kind, ids) in enumerate(log) if kind == "pass" and "late" in ids)
    assert first == arrived + 1, f"arrived during forward {arrived}, first pass at {first}: {log}"
