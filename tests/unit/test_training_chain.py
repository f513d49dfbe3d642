"""Chained passes (``train-demo --chain-blocks``): each link's loss is the loss of the long pass
that commits the whole prefix before its block, and gradients reach the prompt through the cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worker.model.checkpoint import SINGLE_NAME, LoadedModel, load_checkpoint, read_config
from worker.model.demo_trained import TRAINED_CLOVER_DEMO
from worker.model.family import decoding_defaults
from worker.training.chain import Chain, draw_chain
from worker.training.passes import denoise
from worker.training.rows import Row
from worker.training.trainer import (
    TRAINING_FILE,
    TrainConfig,
    TrainConfigError,
    _batch,
    _noisy_batch,
    bucketed_loss,
    check_config,
    train_demo,
)

# the shipped demo's block, as served: bucketed_loss chains with the model's own
BLOCK = decoding_defaults(read_config(TRAINED_CLOVER_DEMO)).block_size


def _chained_step(length: int) -> tuple[LoadedModel, list[Row], tuple[torch.Tensor, ...], Chain]:
    lm = load_checkpoint(TRAINED_CLOVER_DEMO, dtype=torch.float32)
    mask = lm.config.mask_token_id
    assert mask is not None
    rows = _batch(1, TrainConfig(batch=6, decision_share=0.3), lm.tokenizer, BLOCK)
    gen = torch.Generator().manual_seed(1)
    batch = _noisy_batch(rows, BLOCK, mask, gen, served_slots=True, chain=length)
    return lm, rows, batch, draw_chain(rows, batch[3], BLOCK, mask, length, gen)


def test_a_chain_covers_the_answer_blocks_after_the_first_and_skips_decision_rows() -> None:
    """An answer of at most ``chain_blocks`` blocks is trained whole every step (the first pass at
    its first block, the chain after it); a longer one from a block whose chain still reaches its
    last block; decision rows do not chain."""
    length = 3
    _lm, rows, (_noisy, _clean, masked, commit, _valid), chain = _chained_step(length)
    assert any(row.units for row in rows) and any(not row.units for row in rows)
    for r, row in enumerate(rows):
        if row.units:
            assert chain.blocks[r] == []
            continue
        answer = sorted({i // BLOCK for i, p in enumerate(row.predicted) if p})
        start = int(commit[r]) // BLOCK
        if len(answer) <= length:
            assert start == answer[0]
        assert answer[0] <= start <= answer[-1] - length + 1 or start == answer[0]
        assert chain.blocks[r] == list(range(start + 1, min(start + length, answer[-1] + 1)))
        for m in chain.blocks[r]:  # every chained block has a target, and only its own positions
            assert chain.masked[r, m * BLOCK : (m + 1) * BLOCK].any()
        assert not chain.masked[r, : (start + 1) * BLOCK].any() and masked[r].any()


def test_each_link_s_loss_and_gradient_are_the_long_pass_s() -> None:
    """The chain's fused passes (commit block m-1, preview block m, against the first pass's
    cache) give every chained target the loss of the pass that commits blocks 0..m-1 at once (as
    the engine's cached decode and an uncached replay agree), and the same gradient: it runs back
    through the committed K/V and GDN states into the prompt. A step's loss is the weighted mean
    over the first passes' and the links' targets."""
    torch.set_num_threads(1)
    lm, _rows, (noisy, clean, masked, commit, valid), chain = _chained_step(4)
    model = lm.model
    assert sum(len(b) for b in chain.blocks) >= 3
    weight = torch.ones(len(chain.blocks), max(masked.shape[1], chain.width))
    links, count = torch.zeros(()), 0
    for r, blocks in enumerate(chain.blocks):
        for m in blocks:
            ids = chain.clean[r : r + 1, : (m + 1) * BLOCK].clone()
            ids[0, m * BLOCK :] = chain.noisy[r, m * BLOCK : (m + 1) * BLOCK]
            logits = denoise(model, ids, torch.tensor([m * BLOCK]))[0, m * BLOCK :]  # [b, V]
            targets = chain.masked[r, m * BLOCK : (m + 1) * BLOCK]
            gold = chain.clean[r, m * BLOCK : (m + 1) * BLOCK]
            links = links + F.cross_entropy(logits[targets], gold[targets], reduction="sum")
            count += int(targets.sum())
    model.zero_grad()
    (links / count).backward()
    expected = model.embed.weight.grad.clone()
    with torch.no_grad():
        first = denoise(model, noisy, commit, valid)  # [B, T, V]
        total = F.cross_entropy(first[masked], clean[masked], reduction="sum") + links
        for buckets in (1, 2):
            got = bucketed_loss(model, noisy, clean, masked, commit, valid, weight, buckets, chain)
            assert float(got) == pytest.approx(float(total) / (count + int(masked.sum())), abs=1e-4), buckets
    only_links = weight.clone()
    only_links[:, : masked.shape[1]][masked] = 0.0  # the first passes' targets weigh nothing
    model.zero_grad()
    bucketed_loss(model, noisy, clean, masked, commit, valid, only_links, 2, chain).backward()
    got_grad = model.embed.weight.grad
    # tokens only the prompts hold (no link reads them): their gradient came through the cache
    linked = {int(t) for r, blocks in enumerate(chain.blocks) for m in blocks
              for t in chain.clean[r, (m - 1) * BLOCK : (m + 1) * BLOCK]}  # fmt: skip
    prompt_only = sorted({int(t) for r, blocks in enumerate(chain.blocks) if blocks
                          for t in chain.clean[r, : blocks[0] * BLOCK]} - linked)  # fmt: skip
    assert prompt_only and float(got_grad[prompt_only].abs().sum()) > 0
    assert float((got_grad[prompt_only] - expected[prompt_only]).norm()) <= 1e-4 * float(
        expected[prompt_only].norm()
    )
    # float rounding only: another sum order (measured: 3e-5 of the gradient's norm)
    assert float((got_grad - expected).norm()) <= 1e-4 * float(expected.norm())


@pytest.mark.parametrize("options", [{"chain_blocks": 4}, {"chain_blocks": 1, "buckets": 2},
                                     {"chain_blocks": 4, "buckets": 2, "tool_share": 0.3, "tool_keys": 2.0}])
def test_chain_blocks_needs_buckets_and_two_blocks_and_no_key_draw(options: dict[str, float]) -> None:
    with pytest.raises(TrainConfigError, match="chain_blocks"):
        check_config(TrainConfig(**options))  # type: ignore[arg-type]


def test_a_chained_stage_repeats_bit_for_bit(tmp_path: Path) -> None:
    """A stage from the shipped demo with ``chain_blocks`` (the shipped checkpoint's last command,
    shortened): twice, the same bytes; ``training.json`` records the option."""
    torch.set_num_threads(1)
    config = TrainConfig(init_from=str(TRAINED_CLOVER_DEMO), seed=3, steps=2, batch=4, lr=1e-3,
                         served_slots=True, decision_share=0.5, decision_weight=3.0, parallel_slots=1.0,
                         buckets=2, value_share=0.5, chain_blocks=8)  # fmt: skip
    for name in ("a", "b"):
        train_demo(tmp_path / name, config)
    for name in (SINGLE_NAME, "generation_config.json", "training.json", "manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert json.loads((tmp_path / "a" / TRAINING_FILE).read_text())["config"]["chain_blocks"] == 8
