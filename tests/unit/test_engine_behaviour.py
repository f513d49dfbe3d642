"""Engine behaviour on the tiny demo checkpoint: reproducibility inside mixed batches, infilling,
cancellation, deadlines, progress, isolation of failures, capacity limits, stopping."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.engine.engine import Engine, EngineConfig, EngineStopped
from worker.engine.types import (
    FinishReason,
    GenerationRequest,
    InfillSlot,
    InfillTemplate,
    Progress,
    SamplingParams,
)
from worker.model.checkpoint import LoadedModel, load_checkpoint


@pytest.fixture(scope="module", params=["clover", "sdar"])
def tiny(request: pytest.FixtureRequest, demo_checkpoint: Path, sdar_checkpoint: Path) -> LoadedModel:
    """Clover and SDAR. Several tests here assert that a request's tokens do not depend on what
    else shares its batch; that holds up to float rounding only (a batch's shape changes the
    matmul blocking), so it is exact only where no decision is a near-tie. The random LLaDA2 demo
    has such a tie in the long-prefill scenario (3.8e-6 logit differences flip a commit order), so
    LLaDA2 runs the exact-reference tests (test_engine_decoding, faults, slot scoring) instead."""
    return load_checkpoint(demo_checkpoint if request.param == "clover" else sdar_checkpoint)


def make_engine(
    lm: LoadedModel, model: Any = None, eos: tuple[int, ...] | None = None, **config: Any
) -> Engine:
    engine = Engine(
        model if model is not None else lm.model,
        EngineConfig(**{"max_batch": 16, "max_len": 512, **config}),
        mask_token_id=lm.config.mask_token_id,
        eos_token_ids=lm.config.eos_token_ids if eos is None else eos,
        default_block_size=lm.config.block_size,
    )
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engine(tiny: LoadedModel) -> Iterator[Engine]:
    eng = make_engine(tiny)
    yield eng
    eng.stop()


def mixed_requests() -> list[GenerationRequest]:
    """16 different requests: sampling and greedy, both strategies, block sizes, prompt lengths."""
    requests = []
    for i in range(16):
        params = SamplingParams(
            max_new_tokens=6 + i,
            block_size=(2, 4, 8)[i % 3],
            steps_per_block=1 + i % 4,
            strategy="dynamic" if i % 2 else "static",
            threshold=0.3,
            temperature=(0.0, 0.8, 1.2, 1.0)[i % 4],
            top_k=(None, 50, None, 20)[i % 4],
            top_p=(None, None, 0.9, 0.95)[i % 4],
            seed=1000 + i,
            step_budget=(None, 7)[i % 2],
        )
        prompt = [(7 * i + 3 * j) % 400 + 10 for j in range(1 + (5 * i) % 23)]
        requests.append(GenerationRequest(f"mix{i}", prompt, params))
    return requests


def test_same_seed_same_tokens_alone_or_in_a_batch_of_16(engine: Engine) -> None:
    alone = [engine.submit(r).result(timeout=120) for r in mixed_requests()]
    futures = [engine.submit(r) for r in mixed_requests()]  # all at once: one batch of 16
    together = [f.result(timeout=120) for f in futures]
    for a, b in zip(alone, together, strict=True):
        assert a.token_ids == b.token_ids, a.request_id
        assert a.steps_used == b.steps_used
        assert a.finish_reason == b.finish_reason
    assert len({tuple(a.token_ids) for a in alone}) == 16  # they really differ
    assert max(a.steps_used for i, a in enumerate(alone) if i % 2) <= 7  # budgets held


def test_different_seeds_differ(engine: Engine) -> None:
    def sample(seed: int) -> list[int]:
        params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed)
        return engine.submit(GenerationRequest("s", [1, 2, 3], params)).result(timeout=60).token_ids

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_infill_keeps_fixed_tokens_and_only_picks_allowed(tiny: LoadedModel, engine: Engine) -> None:
    pad = tiny.config.pad_token_id
    choices = ((101, 102, 103), (104,), (105, 106))
    digits = (20, 21, 22, 23)
    #            0   1   2  [3  4  5]  6   7  [8  9]  10  [11]
    template = (60, 61, 62, 0, 0, 0, 63, 64, 0, 0, 65, 0)
    slots = (
        InfillSlot(3, 3, allowed_sequences=choices),
        InfillSlot(8, 2, allowed_token_ids=digits),
        InfillSlot(11, 1),
    )
    for temperature, seed in ((0.0, 0), (1.0, 1), (1.5, 2)):
        for block in (2, 4, 8):
            request = GenerationRequest(
                "infill",
                [9, 8, 7, 6, 5],
                SamplingParams(block_size=block, steps_per_block=3, temperature=temperature, seed=seed),
                template=InfillTemplate(template, slots, pad_id=pad),
            )
            result = engine.submit(request).result(timeout=60)
            out = result.token_ids
            assert result.finish_reason is FinishReason.LENGTH
            assert len(out) == len(template)
            for i in (0, 1, 2, 6, 7, 10):
                assert out[i] == template[i]
            choice = result.slot_choices[0]
            padded = [(*c, *(pad,) * (3 - len(c))) for c in choices]
            assert tuple(out[3:6]) in padded
            assert choice.index == padded.index(tuple(out[3:6]))
            assert 0.0 < choice.confidence <= 1.0
            assert set(out[8:10]) <= set(digits)
            assert out[11] != tiny.config.mask_token_id
            assert [c.index for c in result.slot_choices[1:]] == [-1, -1]


def test_infill_errors_are_results_not_exceptions(engine: Engine) -> None:
    bad = InfillTemplate((1, 2, 3), (InfillSlot(2, 2),))
    result = engine.submit(GenerationRequest("bad", [1], template=bad)).result(timeout=10)
    assert result.finish_reason is FinishReason.ERROR
    assert result.error and "outside the template" in result.error


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(steps_per_block=0),
        SamplingParams(temperature=-1.0),
        SamplingParams(top_p=0.0),
        SamplingParams(max_new_tokens=0),
        SamplingParams(max_new_tokens=10_000),
        SamplingParams(strategy="fast"),  # type: ignore[arg-type]
    ],
)
def test_invalid_requests_fail_alone_with_an_error_result(engine: Engine, params: SamplingParams) -> None:
    result = engine.submit(GenerationRequest("bad", [1, 2], params)).result(timeout=10)
    assert result.finish_reason is FinishReason.ERROR
    assert result.error
    ok = engine.submit(GenerationRequest("ok", [1, 2], SamplingParams(max_new_tokens=4))).result(timeout=10)
    assert ok.finish_reason is FinishReason.LENGTH


@pytest.fixture(scope="module")
def engine_without_eos(tiny: LoadedModel) -> Iterator[Engine]:
    """An engine that never stops at EOS (the random demo weights may emit one early)."""
    eng = make_engine(tiny, eos=())
    yield eng
    eng.stop()


def test_progress_at_block_boundaries_and_cancellation(engine_without_eos: Engine) -> None:
    engine = engine_without_eos
    seen: list[Progress] = []
    request = GenerationRequest("c", [1, 2, 3, 4], SamplingParams(max_new_tokens=64, block_size=4))

    def on_progress(p: Progress) -> None:
        seen.append(p)
        if p.blocks_done == 3:
            request.cancel_event.set()

    request.on_progress = on_progress
    result = engine.submit(request).result(timeout=60)
    assert result.finish_reason is FinishReason.CANCELLED
    assert [p.blocks_done for p in seen] == [1, 2, 3]
    assert [p.tokens_committed for p in seen] == [4, 8, 12]
    assert seen[-1].committed_token_ids == result.token_ids
    assert result.blocks == 3
    assert result.steps_used == 12


def test_deadline_checked_every_pass(engine_without_eos: Engine) -> None:
    engine = engine_without_eos
    request = GenerationRequest("d", [1, 2, 3, 4], SamplingParams(max_new_tokens=64, block_size=4))

    def slow(p: Progress) -> None:
        if p.blocks_done == 1:
            request.deadline = time.monotonic()  # passes before the next pass starts

    request.on_progress = slow
    result = engine.submit(request).result(timeout=60)
    assert result.finish_reason is FinishReason.DEADLINE
    assert result.blocks == 1
    expired = GenerationRequest("e", [1], SamplingParams(), deadline=time.monotonic() - 1)
    late = engine.submit(expired).result(timeout=10)
    assert late.finish_reason is FinishReason.DEADLINE
    assert late.steps_used == 0


class FaultyModel(torch.nn.Module):
    """The real model, except that a forward containing ``poison`` raises (a simulated device fault)."""

    def __init__(self, inner: torch.nn.Module, poison: int) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config  # type: ignore[attr-defined]
        self.new_cache = inner.new_cache  # type: ignore[attr-defined]
        self.poison = poison

    def forward(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if bool((input_ids == self.poison).any()):
            raise RuntimeError("simulated device fault")
        return self.inner(input_ids, *args, **kwargs)


def test_a_failing_request_fails_alone(tiny: LoadedModel) -> None:
    eng = make_engine(tiny, FaultyModel(tiny.model, poison=400), max_batch=8)
    try:
        good = [
            GenerationRequest(f"g{i}", [10 + i, 11, 12], SamplingParams(max_new_tokens=12)) for i in range(4)
        ]
        futures = [eng.submit(r) for r in good[:2]]
        bad = eng.submit(GenerationRequest("bad", [400, 1, 2], SamplingParams(max_new_tokens=12)))
        futures += [eng.submit(r) for r in good[2:]]
        with pytest.raises(RuntimeError, match="simulated device fault"):
            bad.result(timeout=60)
        for f in futures:
            assert f.result(timeout=60).finish_reason is FinishReason.LENGTH
        stats = eng.stats()
        assert stats.requests_failed == 1
        assert stats.active == {}
    finally:
        eng.stop()


def test_slot_caps_batch_and_memory_limits(tiny: LoadedModel) -> None:
    # room for 3 sequences of 64 positions, plus (hybrid model) their recurrent state
    probe = make_engine(tiny, max_batch=1)
    state = probe.state_positions  # the per-sequence state of a hybrid model, in positions
    probe.stop()
    limit = 200 + 3 * state
    eng = make_engine(tiny, max_batch=3, max_tokens_in_flight=limit, slot_caps={"joint": 1})
    peaks = {"joint": 0, "all": 0, "positions": 0}
    lock = threading.Lock()

    def watch(_: Progress) -> None:
        s = eng.stats()
        with lock:
            peaks["joint"] = max(peaks["joint"], s.active.get("joint", 0))
            peaks["all"] = max(peaks["all"], sum(s.active.values()))
            peaks["positions"] = max(peaks["positions"], s.positions_in_flight)

    try:
        requests = [
            GenerationRequest(
                f"r{i}",
                [1, 2, 3, 4],
                SamplingParams(max_new_tokens=60, block_size=4, steps_per_block=1),
                slot_class="joint" if i % 2 else "standard",
                on_progress=watch,
            )
            for i in range(8)
        ]
        futures = [eng.submit(r) for r in requests]
        results = [f.result(timeout=120) for f in futures]
        assert all(r.finish_reason is FinishReason.LENGTH for r in results)
        assert peaks["joint"] == 1
        assert peaks["all"] == 3
        assert peaks["positions"] <= limit
        assert (state > 0) == (tiny.config.family == "clover")
        too_big = eng.submit(GenerationRequest("big", [1] * limit, SamplingParams(max_new_tokens=100)))
        assert too_big.result(timeout=10).finish_reason is FinishReason.ERROR
        stats = eng.stats()
        assert stats.steps > 0 and stats.passes > 0 and stats.tokens_committed > 0
        assert sum(map(sum, stats.router_counts)) > 0
    finally:
        eng.stop()


def test_stop_drains_or_cancels(tiny: LoadedModel) -> None:
    eng = make_engine(tiny, max_batch=2)
    futures = [
        eng.submit(GenerationRequest(f"r{i}", [1, 2], SamplingParams(max_new_tokens=32))) for i in range(4)
    ]
    eng.stop(drain=True, timeout=120)
    assert all(f.result(timeout=1).finish_reason is FinishReason.LENGTH for f in futures)
    with pytest.raises(EngineStopped):
        eng.submit(GenerationRequest("late", [1]))

    eng = make_engine(tiny, max_batch=1)
    blocker = threading.Event()
    first = GenerationRequest("slow", [1, 2], SamplingParams(max_new_tokens=64, block_size=4))
    first.on_progress = lambda p: blocker.wait(5) if p.blocks_done == 1 else None
    futures = [eng.submit(first)] + [
        eng.submit(GenerationRequest("q", [3], SamplingParams())) for _ in range(2)
    ]
    stopper = threading.Thread(target=eng.stop, kwargs={"drain": False, "timeout": 60})
    time.sleep(0.2)
    stopper.start()
    time.sleep(0.1)
    blocker.set()
    stopper.join(60)
    reasons = [f.result(timeout=5).finish_reason for f in futures]
    assert reasons == [FinishReason.CANCELLED] * 3


def test_warm_up(engine: Engine) -> None:
    engine.warm_up()
    assert engine.stats().running


def test_long_prefill_joins_running_batch_in_its_own_forward(tiny: LoadedModel) -> None:
    eng = make_engine(tiny, max_batch=4)
    try:
        short = [
            GenerationRequest(f"s{i}", [5 + i, 6, 7], SamplingParams(max_new_tokens=24)) for i in range(3)
        ]
        long = GenerationRequest(
            "long", [(3 * j) % 400 + 1 for j in range(203)], SamplingParams(max_new_tokens=8)
        )
        alone = [eng.submit(r).result(timeout=60).token_ids for r in [*short, long]]
        before = eng.stats()
        futures = [eng.submit(r) for r in short]
        futures.append(eng.submit(long))
        together = [f.result(timeout=60).token_ids for f in futures]
        after = eng.stats()
    finally:
        eng.stop()
    assert together == alone
    assert after.forwards - before.forwards > after.passes - before.passes  # prefill split off once
