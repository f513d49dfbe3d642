"""The engine against the decoding contract on the tiny demo checkpoints of every family.

The reference is ``worker/engine/reference_decode.py``: deliberately plain, no cache carried
between passes, no batching, the whole sequence recomputed for every denoising pass, one request
at a time, Python loops. Greedy or seeded-sampled, the engine must give the same tokens, token
for token, with the same passes, blocks and finish reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from worker.engine.engine import Engine, EngineConfig
from worker.engine.reference_decode import ReferenceResult, reference_decode
from worker.engine.types import FinishReason, GenerationRequest, GenerationResult, SamplingParams
from worker.model.checkpoint import LoadedModel, load_checkpoint
from worker.model.family import decoding_defaults


@pytest.fixture(scope="module")
def tiny(family_checkpoint: Path) -> LoadedModel:
    return load_checkpoint(family_checkpoint)


def make_engine(lm: LoadedModel, *, eos: Sequence[int] | None = None, **config: int) -> Engine:
    cfg = lm.config
    engine = Engine(
        lm.model,
        EngineConfig(**{"max_batch": 16, "max_len": 512, **config}),
        mask_token_id=cfg.mask_token_id,
        eos_token_ids=cfg.eos_token_ids if eos is None else eos,
        default_block_size=cfg.block_size,
    )
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engine(tiny: LoadedModel) -> Iterator[Engine]:
    eng = make_engine(tiny)
    yield eng
    eng.stop()


def reference(
    lm: LoadedModel, prompt: list[int], params: SamplingParams, *, eos: Sequence[int] | None = None
) -> ReferenceResult:
    """``worker/engine/reference_decode.py`` for one request of ``lm`` (EOS ids: the config's, or ``eos``)."""
    cfg = lm.config
    return reference_decode(lm.model, prompt, params, mask_token_id=cfg.mask_token_id,
                            eos_token_ids=cfg.eos_token_ids if eos is None else eos)  # fmt: skip


def _same(result: GenerationResult, expected: ReferenceResult) -> None:
    """Token for token, and the same passes, blocks and reason."""
    got = (result.token_ids, result.steps_used, result.blocks, result.finish_reason)
    assert got == (expected.token_ids, expected.steps_used, expected.blocks, expected.finish_reason)


def run(engine: Engine, prompt: list[int], **params: object) -> GenerationResult:
    return engine.submit(GenerationRequest("t", prompt, SamplingParams(**params))).result(timeout=120)  # type: ignore[arg-type]


PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 12], [8, 9, 10, 11], [42]]


@pytest.mark.parametrize(
    ("block", "steps", "strategy", "threshold"),
    [
        (4, 4, "static", 0.9),
        (4, 2, "static", 0.9),
        (8, 3, "static", 0.9),
        (2, 1, "static", 0.9),
        (4, 4, "dynamic", 0.05),
        (8, 8, "dynamic", 0.02),
    ],
)
def test_greedy_equals_full_recompute_reference(
    tiny: LoadedModel, engine: Engine, block: int, steps: int, strategy: str, threshold: float
) -> None:
    eos = tiny.config.eos_token_ids
    futures = [
        engine.submit(
            GenerationRequest(
                f"p{i}",
                prompt,
                SamplingParams(
                    max_new_tokens=13,
                    block_size=block,
                    steps_per_block=steps,
                    strategy=strategy,  # type: ignore[arg-type]
                    threshold=threshold,
                ),
            )
        )
        for i, prompt in enumerate(PROMPTS)
    ]  # all four in one batch: different lengths, partial prompt blocks at different offsets
    total_passes = total_blocks = 0
    assert len(futures) == len(PROMPTS)
    for prompt, future in zip(PROMPTS, futures, strict=True):
        result = future.result(timeout=120)
        params = SamplingParams(max_new_tokens=13, block_size=block, steps_per_block=steps,
                                strategy=strategy, threshold=threshold)  # type: ignore[arg-type]  # fmt: skip
        expected = reference(tiny, prompt, params, eos=eos)
        _same(result, expected)
        total_passes += expected.steps_used
        total_blocks += result.blocks
    if strategy == "dynamic":  # the low threshold really commits several masks in one pass
        assert total_passes < total_blocks * min(steps, block)


SAMPLED = [  # (temperature, top_k, top_p, strategy, threshold, step_budget)
    (1.0, None, None, "static", 0.9, None),
    (0.8, 20, 0.9, "dynamic", 0.05, None),
    (0.7, None, 0.8, "static", 0.9, 5),  # a budget that lowers the steps, then stops
    (0.0, 5, 0.5, "dynamic", 0.2, None),  # greedy with filters: the confidence is the filtered one
]


def test_seeded_sampling_equals_the_reference(tiny: LoadedModel, engine: Engine) -> None:
    """The engine's per-request generator gives the reference's draws: same seed, same tokens,
    inside one batch of requests of different lengths, filters and budgets."""
    cases = [
        (prompt, SamplingParams(max_new_tokens=13, block_size=4, steps_per_block=3, strategy=strategy,  # type: ignore[arg-type]
                                threshold=threshold, temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=seed, step_budget=budget))
        for seed, (temperature, top_k, top_p, strategy, threshold, budget) in enumerate(SAMPLED)
        for prompt in PROMPTS
    ]  # fmt: skip
    futures = [engine.submit(GenerationRequest(f"s{i}", prompt, p)) for i, (prompt, p) in enumerate(cases)]
    assert len(futures) == len(SAMPLED) * len(PROMPTS)
    for (prompt, params), future in zip(cases, futures, strict=True):
        _same(future.result(timeout=120), reference(tiny, prompt, params))
    drawn = [future.result().token_ids for future in futures[: len(PROMPTS)]]
    again = [run(engine, prompt, **vars(params)).token_ids for prompt, params in cases[: len(PROMPTS)]]
    assert drawn == again and any(drawn)  # seeded: the same draws alone as in the batch


def test_eos_and_budget_stops_equal_the_reference(tiny: LoadedModel) -> None:
    """An EOS inside the output ends generation after its block; a budget ends it at a block start."""
    prompt = [11, 12, 13, 14, 15]
    params = SamplingParams(max_new_tokens=24, block_size=4, steps_per_block=2, strategy="static")
    free = reference(tiny, prompt, params, eos=())
    assert free.finish_reason is FinishReason.LENGTH and len(free.token_ids) == 24
    eos = [free.token_ids[5]]
    eos_engine = make_engine(tiny, eos=eos, max_batch=2)
    try:
        stopped = run(eos_engine, prompt, **vars(params))
        short = run(eos_engine, prompt, **{**vars(params), "step_budget": 3})
    finally:
        eos_engine.stop()
    expected = reference(tiny, prompt, params, eos=eos)
    assert expected.finish_reason is FinishReason.EOS
    _same(stopped, expected)
    budget = reference(tiny, prompt, dataclasses.replace(params, step_budget=3), eos=eos)
    assert budget.finish_reason in (FinishReason.BUDGET, FinishReason.EOS)
    _same(short, budget)


def test_an_eos_settled_mid_block_ends_it_early_in_engine_and_reference(tiny: LoadedModel) -> None:
    """One token per pass: an EOS committed while the positions after it are still masks, with
    every position before it committed, ends the block at that pass (rule 5), in the engine as in
    the reference; the tokens are those of the run that filled the block."""
    prompt = [11, 12, 13, 14, 15]
    params = SamplingParams(max_new_tokens=24, block_size=4, steps_per_block=4, strategy="static")
    free = reference(tiny, prompt, params, eos=())
    fired = []
    for token in dict.fromkeys(free.token_ids):  # each generated token, declared the EOS in turn
        first = free.token_ids.index(token)
        expected = reference(tiny, prompt, params, eos=[token])
        assert expected.token_ids == free.token_ids[:first]
        masks = ((len(prompt) + first) // 4 + 1) * 4 - len(prompt)  # up to the end of the EOS's block
        if expected.steps_used < masks:  # one mask per pass: the block ended before it was full
            fired.append((token, expected))
    assert fired, "no EOS choice ended a block early: the test would check nothing"
    for token, expected in fired[:3]:
        eos_engine = make_engine(tiny, eos=[token], max_batch=2)
        try:
            _same(run(eos_engine, prompt, **vars(params)), expected)
        finally:
            eos_engine.stop()


def test_partial_prompt_block_is_decoded_first_with_its_prompt_fixed(engine: Engine) -> None:
    # prompt of 5 with block 4: block 1 holds position 4 (prompt) and 5..7 (3 masks)
    result = run(engine, [1, 2, 3, 4, 5], max_new_tokens=3, block_size=4, steps_per_block=4)
    assert result.blocks == 1
    assert result.steps_used == 3  # quotas [1, 1, 1]; the zero-quota fourth step is skipped
    assert len(result.token_ids) == 3
    assert result.finish_reason is FinishReason.LENGTH


def test_silent_params_take_the_family_defaults(tiny: LoadedModel, engine: Engine) -> None:
    """Clover, LLaDA2: steps = block size, dynamic, 0.95; SDAR: 4 steps, static, 0.9."""
    defaults = decoding_defaults(tiny.config)
    block = tiny.config.block_size or 4
    prompt = [5, 17, 99, 3, 250]
    eng = make_engine(tiny, eos=(), max_batch=2)
    try:
        for size in (block, 8):  # the config's block, and a request's block of 8
            resolved = SamplingParams(
                max_new_tokens=10, block_size=size, steps_per_block=defaults.steps_for(size),
                strategy=defaults.strategy, threshold=defaults.threshold,  # type: ignore[arg-type]
            )  # fmt: skip
            result = run(eng, prompt, max_new_tokens=10, block_size=size)
            _same(result, reference(tiny, prompt, resolved, eos=()))
        assert defaults.steps_for(8) == (4 if tiny.config.family == "sdar" else 8)
    finally:
        eng.stop()


def test_steps_follow_quotas_per_block(engine: Engine) -> None:
    # prompt 6, block 4, 10 new -> region 6..15: blocks of 2, 4, 4 masks; S = 3 -> 2 + 3 + 3 passes
    result = run(engine, [1, 2, 3, 4, 5, 6], max_new_tokens=10, block_size=4, steps_per_block=3)
    assert result.blocks == 3
    assert result.steps_used == 8


def test_max_new_tokens_cuts_the_rounded_region(engine: Engine) -> None:
    result = run(engine, [7, 8, 9, 10], max_new_tokens=6, block_size=4, steps_per_block=2)
    assert result.tokens == len(result.token_ids) == 6
    assert result.blocks == 2  # 6 new tokens rounded up to two whole blocks
    assert result.finish_reason is FinishReason.LENGTH


def test_eos_stops_after_its_block_and_cuts_output(tiny: LoadedModel, engine: Engine) -> None:
    prompt = [11, 12, 13, 14, 15]
    free = run(engine, prompt, max_new_tokens=24, block_size=4, steps_per_block=2)
    assert free.finish_reason is FinishReason.LENGTH
    # declare the token generated at output index 5 an EOS: the same greedy run must stop there
    eos_token = free.token_ids[5]
    first = free.token_ids.index(eos_token)
    eos_engine = make_engine(tiny, eos=[eos_token], max_batch=2)
    try:
        stopped = run(eos_engine, prompt, max_new_tokens=24, block_size=4, steps_per_block=2)
    finally:
        eos_engine.stop()
    assert stopped.finish_reason is FinishReason.EOS
    assert stopped.token_ids == free.token_ids[:first]
    eos_block = (len(prompt) + first) // 4 - len(prompt) // 4 + 1  # blocks up to the EOS's block
    assert stopped.blocks == eos_block
    assert stopped.steps_used < free.steps_used or eos_block == free.blocks


def test_budget_is_never_exceeded_and_lowers_steps(engine: Engine) -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    full = run(engine, prompt, max_new_tokens=16, block_size=4, steps_per_block=4)
    assert full.steps_used == 16
    same = run(engine, prompt, max_new_tokens=16, block_size=4, steps_per_block=4, step_budget=16)
    assert same.token_ids == full.token_ids  # an affordable budget does not change the output
    for budget in (15, 9, 4):
        tight = run(engine, prompt, max_new_tokens=16, block_size=4, steps_per_block=4, step_budget=budget)
        assert tight.steps_used <= budget
        assert tight.finish_reason is FinishReason.LENGTH  # every block still decoded
        assert len(tight.token_ids) == 16
    short = run(engine, prompt, max_new_tokens=16, block_size=4, steps_per_block=4, step_budget=2)
    assert short.finish_reason is FinishReason.BUDGET
    assert short.steps_used == 2
    assert short.blocks == 2
    assert len(short.token_ids) == 8
    none = run(engine, prompt, max_new_tokens=16, block_size=4, steps_per_block=4, step_budget=0)
    assert none.finish_reason is FinishReason.BUDGET
    assert none.steps_used == 0
    assert none.token_ids == []
