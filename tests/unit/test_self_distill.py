"""The self-distillation stage: the starting checkpoint's own answers, decoded by the trainer's
pass as the engine decodes them, replace a stage's generation rows; the stage repeats bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bench.demo_quality import started_engine
from worker.engine.types import GenerationRequest, SamplingParams
from worker.model.checkpoint import SINGLE_NAME, load_checkpoint
from worker.model.demo_trained import TRAINED_CLOVER_DEMO
from worker.training.corpus import generation_case
from worker.training.rows import generation_prompt
from worker.training.self_distill import MAX_ANSWER, cached_greedy_answers, greedy_answers, own_answer_rows
from worker.training.trainer import RESUME_FILE, TrainConfig, TrainConfigError, _batch, train_demo

CASES = 12


@pytest.mark.parametrize("decode", [greedy_answers, cached_greedy_answers], ids=["whole", "cached"])
def test_the_trainer_s_greedy_decode_is_the_engine_s_one_token_per_pass_decode(decode: Any) -> None:
    """The pool's answers are what ``static`` decoding with one step per token serves: the same
    tokens up to EOS for every case that ends (a case without EOS in ``MAX_ANSWER`` is left out),
    decoded with every pass over the whole prefix or against a cache (``--cached-pool``)."""
    torch.set_num_threads(1)
    lm = load_checkpoint(TRAINED_CLOVER_DEMO, dtype=torch.float32)
    block, mask = lm.config.block_size or 4, lm.config.mask_token_id
    assert mask is not None
    prompts = [generation_prompt(generation_case("train", 1, i), lm.tokenizer) for i in range(CASES)]
    mine = decode(lm.model, prompts, block, mask, set(lm.tokenizer.eos_token_ids))
    engine = started_engine(lm)
    try:
        params = SamplingParams(max_new_tokens=MAX_ANSWER, strategy="static", steps_per_block=block)
        # one at a time: the engine's rows alone, whatever its batching would have been
        served = [engine.submit(GenerationRequest(f"g{i}", prompt, params)).result()
                  for i, prompt in enumerate(prompts)]  # fmt: skip
    finally:
        engine.stop()
    ended = [(m, s) for m, s in zip(mine, served, strict=True) if m is not None]
    assert len(ended) >= CASES * 3 // 4
    for answer, result in ended:
        assert answer == result.token_ids
    for answer, result in zip(mine, served, strict=True):
        if answer is None:
            assert result.finish_reason == "length"


def test_a_stage_s_generation_rows_are_its_own_answers() -> None:
    torch.set_num_threads(1)
    lm = load_checkpoint(TRAINED_CLOVER_DEMO, dtype=torch.float32)
    mask = lm.config.mask_token_id
    assert mask is not None
    own = own_answer_rows(lm.model, lm.tokenizer, 1, 4, 4, mask)
    config = TrainConfig(batch=8, decision_share=0.0)
    rows = _batch(0, config, lm.tokenizer, 4, own)
    assert own and all(row in own and row.whole for row in rows)  # the block masked whole
    assert not any(row.whole for row in _batch(0, config, lm.tokenizer, 4))


def test_self_distill_needs_a_trained_start() -> None:
    with pytest.raises(TrainConfigError, match="needs init_from"):
        train_demo(Path("/nonexistent"), TrainConfig(steps=1, self_distill=4))
    with pytest.raises(TrainConfigError, match="needs self_distill"):
        train_demo(Path("/nonexistent"), TrainConfig(steps=1, cached_pool=True))


def test_the_cached_decode_is_the_whole_pass_decode() -> None:
    """Over more cases than the engine comparison (two batches of rows at different blocks, rows
    ending in different blocks, rows that reach ``MAX_ANSWER`` without EOS) and prompts cut to
    lengths a block divides or shorter than a block, the cached decode gives the same answers; so
    the pools of the two are the same too."""
    torch.set_num_threads(1)
    lm = load_checkpoint(TRAINED_CLOVER_DEMO, dtype=torch.float32)
    mask = lm.config.mask_token_id
    assert mask is not None
    block, eos = lm.config.block_size or 4, set(lm.tokenizer.eos_token_ids)
    prompts = [generation_prompt(generation_case("train", 2, i), lm.tokenizer) for i in range(32)]
    cut = [prompts[0][: block * 40], prompts[1][: block - 3], prompts[2][:1]]  # a whole block, 5 and 1 tokens
    for batch in (prompts[:16], prompts[16:], cut):
        whole = greedy_answers(lm.model, batch, block, mask, eos)
        assert cached_greedy_answers(lm.model, batch, block, mask, eos) == whole
    answers = greedy_answers(lm.model, prompts, block, mask, eos)
    ends = {len(a) // block for a in answers if a is not None}  # the block each answer ends in
    assert len(ends) >= 2 and None in answers + greedy_answers(lm.model, cut, block, mask, eos)
    assert own_answer_rows(lm.model, lm.tokenizer, 2, 32, block, mask, cached=True) == own_answer_rows(
        lm.model, lm.tokenizer, 2, 32, block, mask)


def test_the_cached_decode_refuses_a_model_without_a_clover_cache() -> None:
    sdar = SimpleNamespace(config=SimpleNamespace(family="sdar"))  # only its family is read
    with pytest.raises(ValueError, match="Clover"):
        cached_greedy_answers(sdar, [[1, 2, 3]], 8, 0, {1})


def test_a_self_distill_stage_repeats_bit_for_bit_and_resumes_on_the_same_pool(tmp_path: Path) -> None:
    """Twice, the same bytes; interrupted at its second step and resumed from the first one's
    resume point (the pool rebuilt from the starting weights, not the resume point's), the same
    bytes again."""
    torch.set_num_threads(1)
    config = TrainConfig(steps=3, batch=4, decision_share=0.5, init_from=str(TRAINED_CLOVER_DEMO),
                         self_distill=4, buckets=2, save_every=1)  # fmt: skip
    for name in ("a", "b"):
        train_demo(tmp_path / name, config)

    class Interrupt(Exception):
        pass

    def stop_at_2(step: int, loss: float) -> None:
        if step == 2:
            raise Interrupt

    with pytest.raises(Interrupt):
        train_demo(tmp_path / "c", config, progress=stop_at_2)
    assert (tmp_path / "c" / RESUME_FILE).is_file()
    train_demo(tmp_path / "c", config)
    for name in (SINGLE_NAME, "generation_config.json", "training.json", "manifest.json"):
        for other in ("b", "c"):
            same = (tmp_path / "a" / name).read_bytes() == (tmp_path / other / name).read_bytes()
            assert same, (name, other)
    assert (tmp_path / "a" / SINGLE_NAME).read_bytes() != (TRAINED_CLOVER_DEMO / SINGLE_NAME).read_bytes()


def test_a_cached_pool_stage_decodes_against_the_cache_and_trains_the_same_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cached_pool`` reaches the pool's decode (its rows then train the step: the weights equal
    the whole-pass stage's, whose pool is the same), and is recorded in ``training.json``."""
    torch.set_num_threads(1)
    from worker.training import self_distill

    calls: list[int] = []
    cached = self_distill.cached_greedy_answers

    def counted(*args: Any) -> list[list[int] | None]:
        calls.append(len(args[1]))
        return cached(*args)

    monkeypatch.setattr(self_distill, "cached_greedy_answers", counted)
    base = dict(steps=1, batch=4, decision_share=0.5, init_from=str(TRAINED_CLOVER_DEMO), self_distill=4,
                buckets=2, save_every=1)  # fmt: skip
    train_demo(tmp_path / "whole", TrainConfig(**base))  # type: ignore[arg-type]
    assert not calls
    train_demo(tmp_path / "cached", TrainConfig(**base, cached_pool=True))  # type: ignore[arg-type]
    assert calls == [4]
    weights = [(tmp_path / name / SINGLE_NAME).read_bytes() for name in ("whole", "cached")]
    assert weights[0] == weights[1]
    assert json.loads((tmp_path / "cached" / "training.json").read_text())["config"]["cached_pool"] is True
