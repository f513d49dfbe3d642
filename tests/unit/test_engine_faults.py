"""Engine robustness: a pass that fails after its forward is re-run row by row without committing
the rows' cache positions twice, and random mixes of prompt lengths, block sizes, templates and
cancellations in one small engine all finish without an engine fault."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import worker.engine.runner as runner_module
from worker.engine.engine import Engine, EngineConfig
from worker.engine.types import (
    FinishReason,
    GenerationRequest,
    InfillSlot,
    InfillTemplate,
    SamplingParams,
)
from worker.model.checkpoint import LoadedModel, load_checkpoint


@pytest.fixture(scope="module")
def tiny(family_checkpoint: Path) -> LoadedModel:
    return load_checkpoint(family_checkpoint)


def make_engine(lm: LoadedModel, **config: Any) -> Engine:
    engine = Engine(
        lm.model,
        EngineConfig(**{"max_batch": 4, "max_len": 128, **config}),
        mask_token_id=lm.config.mask_token_id,
        eos_token_ids=lm.config.eos_token_ids,
        default_block_size=lm.config.block_size,
    )
    engine.start()
    return engine


def greedy_requests() -> list[GenerationRequest]:
    """Prompts of different lengths (one with a long prefill), all admitted in one pass."""
    lengths = (3, 9, 40, 17)
    return [
        GenerationRequest(
            f"g{i}",
            [(11 * i + 5 * j) % 300 + 10 for j in range(n)],
            SamplingParams(max_new_tokens=12, block_size=4, steps_per_block=2, seed=i),
        )
        for i, n in enumerate(lengths)
    ]


def run_all(engine: Engine, requests: list[GenerationRequest]) -> list[list[int]]:
    futures = [engine.submit(r) for r in requests]
    results = [f.result(timeout=120) for f in futures]
    assert all(r.finish_reason is not FinishReason.ERROR for r in results), [r.error for r in results]
    return [r.token_ids for r in results]


def test_a_pass_failing_after_its_forward_is_retried_without_double_commits(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(tiny)
    try:
        expected = run_all(engine, greedy_requests())
        real_select = runner_module.select_tokens
        failures = {"left": 3}
        lock = threading.Lock()

        def flaky_select(logits: Any, *args: Any) -> Any:
            # fail batched passes (more than one row) a few times, after the forward ran
            with lock:
                if logits.shape[0] > 1 and failures["left"] > 0:
                    failures["left"] -= 1
                    raise RuntimeError("injected fault after the forward")
            return real_select(logits, *args)

        monkeypatch.setattr(runner_module, "select_tokens", flaky_select)
        got = run_all(engine, greedy_requests())
        assert failures["left"] == 0
        assert got == expected
    finally:
        engine.stop()


@pytest.mark.parametrize("seed", [0])
def test_random_mixes_finish_without_engine_faults(tiny: LoadedModel, seed: int) -> None:
    rng = random.Random(seed)
    max_len = rng.choice([64, 96, 128])
    engine = make_engine(tiny, max_batch=rng.choice([2, 4, 8]), max_len=max_len)
    requests = []
    try:
        futures = []
        for i in range(16):
            n = rng.choice([1, 2, 3, 5, 8, 9, 16, 17, 31, 33, 40, 63, 70])
            params = SamplingParams(
                max_new_tokens=rng.randint(1, 40),
                block_size=rng.choice([None, 1, 2, 3, 4, 8, 16]),
                steps_per_block=rng.randint(1, 4),
                strategy=rng.choice(["static", "dynamic"]),
                threshold=0.3,
                temperature=rng.choice([0.0, 0.9]),
                seed=i,
                step_budget=rng.choice([None, None, 3]),
            )
            template = None
            if rng.random() < 0.3:
                length = rng.randint(2, 20)
                start = rng.randrange(length)
                span = rng.randint(1, length - start)
                restricted = rng.random() < 0.5
                template = InfillTemplate(
                    tuple(rng.randrange(10, 400) for _ in range(length)),
                    (
                        InfillSlot(
                            start,
                            span,
                            allowed_sequences=tuple(
                                tuple(rng.randrange(10, 400) for _ in range(span)) for _ in range(3)
                            )
                            if restricted
                            else None,
                        ),
                    ),
                )
            request = GenerationRequest(f"r{i}", [rng.randrange(10, 400) for _ in range(n)], params, template)
            requests.append(request)
            futures.append(engine.submit(request))
            if rng.random() < 0.2:
                time.sleep(rng.random() * 0.02)
            if rng.random() < 0.15:
                rng.choice(requests).cancel_event.set()
        for request, future in zip(requests, futures, strict=True):
            result = future.result(timeout=120)  # an engine fault would raise here
            if result.finish_reason is FinishReason.ERROR:  # only requests that cannot fit
                assert "exceeds max_len" in (result.error or ""), (request.request_id, result.error)
        assert engine.stats().running
    finally:
        engine.stop()
