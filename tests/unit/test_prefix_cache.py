"""The prefix cache: shared prompt blocks computed once never change a token.

Every family's tiny demo checkpoint decodes the same requests with sharing off, on, and on under a
budget so small that every stored prefix is evicted at once; the tokens must be identical, greedy
and seeded. Requests arrive together (one admission round), across rounds (a batch smaller than
the burst) and one job after another (the store across jobs), and as an independent decision
(infill templates over one context).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from worker.decisions import DecisionSpec, plan_decision
from worker.decisions.spec import DecisionQuestion
from worker.engine.engine import Engine, EngineConfig
from worker.engine.prefix_cache import PrefixCache, chain_hashes
from worker.engine.types import GenerationRequest, SamplingParams
from worker.model.checkpoint import LoadedModel, load_checkpoint
from worker.model.kv_cache import PrefixState

BIG = 1 << 30


@pytest.fixture(scope="module")
def tiny(family_checkpoint: Path) -> LoadedModel:
    return load_checkpoint(family_checkpoint)


def _engine(lm: LoadedModel, prefix_bytes: int, max_batch: int = 8) -> Engine:
    engine = Engine(
        lm.model,
        EngineConfig(max_batch=max_batch, max_len=320, prefix_cache_bytes=prefix_bytes),
        mask_token_id=lm.config.mask_token_id,
        eos_token_ids=(),  # random weights: decode the whole region every time
        default_block_size=lm.config.block_size,
    )
    engine.start()
    return engine


def _prompts(lm: LoadedModel, n: int, context: int = 37, salt: int = 0) -> list[list[int]]:
    """``n`` prompts over one ``context``-token document, each with its own question tail."""
    vocab, mask = lm.config.vocab_size, lm.config.mask_token_id
    doc = [(13 * j + 5) % vocab for j in range(context)]
    prompts = []
    for i in range(n):
        tail = [(7 * i + 3 * j + 100 + 50 * salt) % vocab for j in range(3 + i % 6)]
        prompts.append([t if t != mask else t + 1 for t in doc + tail])
    return prompts


def _params(seeded: bool, i: int) -> SamplingParams:
    if seeded:
        return SamplingParams(max_new_tokens=6, temperature=0.9, top_k=20, seed=100 + i)
    return SamplingParams(max_new_tokens=6)


def _run(engine: Engine, prompts: list[list[int]], seeded: bool, *, one_by_one: bool) -> list[list[int]]:
    requests = [GenerationRequest(f"r{i}", p, _params(seeded, i)) for i, p in enumerate(prompts)]
    if one_by_one:
        return [engine.submit(r).result().token_ids for r in requests]
    futures = engine.submit_many(requests)  # one admission round (as many as the batch takes)
    return [f.result().token_ids for f in futures]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_tokens_identical_with_sharing_off_on_and_evicted(tiny: LoadedModel, seeded: bool) -> None:
    prompts, later = _prompts(tiny, 5), _prompts(tiny, 3, salt=1)  # later: new questions, same document
    engines = {name: _engine(tiny, size) for name, size in (("off", 0), ("on", BIG), ("tiny", 1))}
    narrow = _engine(tiny, BIG, max_batch=2)  # the burst needs three admission rounds
    try:
        off = _run(engines["off"], prompts, seeded, one_by_one=False)
        off_later = _run(engines["off"], later, seeded, one_by_one=True)
        assert all(len(t) == 6 for t in off)
        for name in ("on", "tiny"):
            assert _run(engines[name], prompts, seeded, one_by_one=False) == off, name
            assert _run(engines[name], later, seeded, one_by_one=True) == off_later, name  # across jobs
        assert _run(narrow, prompts, seeded, one_by_one=False) == off
        on, small, rounds = engines["on"].stats(), engines["tiny"].stats(), narrow.stats()
    finally:
        for engine in (*engines.values(), narrow):
            engine.stop()
    assert engines["off"].stats().prefix_reused_positions == 0
    assert on.prefix_cache_hits >= 4 + 3  # the burst's four followers, then every later job
    assert on.prefix_reused_positions > 0 and on.prefix_cache_entries >= 1
    assert rounds.prefix_cache_hits >= 3  # later rounds hit what the first one stored
    # a 1-byte budget still shares inside one round, and evicts every prefix right after
    assert small.prefix_cache_evictions == small.prefix_cache_stores > 0
    assert small.prefix_cache_entries == 0 and small.prefix_cache_bytes == 0
    assert small.prefix_reused_positions > 0


def test_shared_prefix_is_prefilled_once(tiny: LoadedModel) -> None:
    prompts = _prompts(tiny, 6, context=61)
    block = tiny.config.block_size
    whole = sum(len(p) // block * block for p in prompts)
    engines = [_engine(tiny, 0), _engine(tiny, BIG)]
    try:
        outs = [_run(e, prompts, False, one_by_one=False) for e in engines]
        off, on = (e.stats() for e in engines)
    finally:
        for e in engines:
            e.stop()
    assert outs[0] == outs[1]
    assert off.prefill_positions == whole
    assert on.prefill_positions + on.prefix_reused_positions == whole
    shared = min(len(p) for p in prompts) // block * block  # at least this much is common
    assert on.prefix_reused_positions >= 5 * (shared - block)
    assert on.prefix_cache_stores >= 1


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_independent_decision_shares_its_context(tiny: LoadedModel, seeded: bool) -> None:
    context = " ".join(f"clause {i}: the supplier shall deliver goods on time." for i in range(3))
    questions = tuple(
        DecisionQuestion(id=f"q{i}", text=f"Is clause {i} breached?", choices=("yes", "no")) for i in range(5)
    )
    spec = DecisionSpec(mode="independent", context=context, questions=questions, rationale=True)
    params = SamplingParams(temperature=0.8 if seeded else 0.0, seed=11 if seeded else None)
    results = []
    stats = []
    for size in (0, BIG):
        engine = _engine(tiny, size)
        try:
            plan = plan_decision(spec, tiny.tokenizer, request_id="d", params=params, rationale_tokens=6,
                                 slot_class="standard")
            futures = engine.submit_many(plan.requests)  # one admission round, as run_decision does
            done = [f.result() for f in futures]
            results.append([(r.token_ids, [c.index for c in r.slot_choices]) for r in done])
            stats.append(engine.stats())
        finally:
            engine.stop()
    assert results[0] == results[1]
    prompts = [r.prompt_ids for r in plan.requests]
    common = next(i for i, col in enumerate(zip(*prompts, strict=False)) if len(set(col)) > 1)
    assert common > 2 * tiny.config.block_size  # the context is a common token prefix of every question
    assert stats[1].prefix_cache_hits == len(questions) - 1
    assert stats[1].prefix_reused_positions >= (len(questions) - 1) * (common // tiny.config.block_size - 1)


def test_a_failed_prefix_prefill_only_costs_the_sharing(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = _prompts(tiny, 3)
    engines = [_engine(tiny, 0), _engine(tiny, BIG)]

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected prefill fault")

    monkeypatch.setattr(engines[1].runner, "run_prefill", broken)
    try:
        outs = [_run(e, prompts, False, one_by_one=False) for e in engines]
        stats = engines[1].stats()
    finally:
        for e in engines:
            e.stop()
    assert outs[0] == outs[1]
    assert stats.prefix_cache_stores == 0 and stats.prefix_reused_positions == 0
    assert stats.requests_failed == 0


def test_worker_telemetry_exports_the_counters(tiny: LoadedModel) -> None:
    from scheduler.observability.cluster_metrics import ClusterCollector
    from worker.telemetry import snapshot_from_stats

    engine = _engine(tiny, BIG)
    try:
        _run(engine, _prompts(tiny, 3), False, one_by_one=False)
        stats = engine.stats()
    finally:
        engine.stop()
    snap = snapshot_from_stats(stats, worker_id="w1", device="cpu", queues=("standard",), state="ready",
                               model_name=None, model_version=None, model_load_seconds=None)
    families = {f.name: f for f in ClusterCollector._worker_families([snap.to_payload()])}
    events = {s.labels["event"]: s.value for s in families["cloverq_prefix_cache_events"].samples
              if s.name.endswith("_total")}
    assert events == {"hit": stats.prefix_cache_hits, "miss": stats.prefix_cache_misses,
                      "evict": stats.prefix_cache_evictions}
    assert events["hit"] >= 2
    assert families["cloverq_prefix_cache_bytes"].samples[0].value == stats.prefix_cache_bytes > 0
    off = snapshot_from_stats(dataclasses.replace(stats, prefix_cache_budget_bytes=0), worker_id="w1",
                              device="cpu", queues=(), state="ready", model_name=None, model_version=None,
                              model_load_seconds=None)
    assert off.prefix_cache is None


# ---- the store on its own --------------------------------------------------------------------


def _state(n: int) -> PrefixState:
    return PrefixState(length=n, k=[torch.zeros(1, n, 2)], v=[torch.zeros(1, n, 2)])  # 16 n bytes


def test_chain_hashes_name_whole_prefixes() -> None:
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = chain_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert chain_hashes([5, 6, 7, 8], 4)[0] != a[1]  # the same block after another prefix differs
    assert chain_hashes([1, 2, 3, 4], 2)[1] != a[0]  # other block sizes never match


def test_store_evicts_least_recently_used_and_never_a_pinned_entry() -> None:
    cache = PrefixCache(budget_bytes=40 * 16)
    keys = chain_hashes(list(range(48)), 4)
    e1 = cache.put(keys[1], list(range(8)), 4, _state(8))
    cache.put(keys[3], list(range(16)), 4, _state(16))
    assert cache.get(keys[1], list(range(8)), 4) is e1  # e1 becomes most recently used
    assert cache.get(keys[1], list(range(1, 9)), 4) is None  # ids are checked, not only the key
    cache.pin(e1)
    cache.put(keys[5], list(range(24)), 4, _state(24))  # 48 positions > budget of 40
    assert cache.trim() == 1 and cache.get(keys[3], list(range(16)), 4) is None
    big = cache.put(keys[11], list(range(48)), 4, _state(48))
    cache.pin(big)
    cache.trim()  # only pinned entries are left over budget: they stay
    assert len(cache) == 2 and cache.bytes == (8 + 48) * 16
    cache.unpin(big)
    cache.unpin(e1)
    assert cache.get(keys[1], list(range(8)), 4) is e1  # e1 is used again: the big one goes first
    cache.trim()
    assert len(cache) == 1 and cache.deepest(list(range(48)), keys, 4) is e1
    assert cache.counters().evictions == 3
    peers: collections.Counter[bytes] = collections.Counter(keys[:5])
    assert cache.shared_depth(keys, peers) == 0
    peers.update(keys[:3])
    assert cache.shared_depth(keys, peers) == 3
    cache.remember(keys[:7])
    assert cache.shared_depth(keys, peers) == 7


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
