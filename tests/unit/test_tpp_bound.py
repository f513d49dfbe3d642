"""bench.tpp_bound's gold-prefix decode on the shipped demo: its counts hold the invariants of the
engine's ``dynamic`` rule (at least one commit per pass, at least one pass per block, no more sure
positions than positions, the rate within the layout's ceiling)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from bench.tpp_bound import gold_prefix_bound, gold_row, grouped
from worker.model.checkpoint import load_checkpoint
from worker.model.demo_trained import TRAINED_CLOVER_DEMO
from worker.model.manifest import write_manifest
from worker.training.corpus import generation_cases
from worker.training.shape import reblock


def test_gold_prefix_counts_stay_within_the_layout() -> None:
    torch.set_num_threads(1)
    lm = load_checkpoint(TRAINED_CLOVER_DEMO, dtype=torch.float32)
    lm.model.eval()
    block, mask = lm.config.block_size or 4, lm.config.mask_token_id
    assert mask is not None
    rows = [gold_row(c, lm.tokenizer, block) for c in generation_cases("eval", 1, 3)]
    tallies = gold_prefix_bound(lm.model, rows, block, mask, set(lm.tokenizer.eos_token_ids), 0.9)
    for row, tally in zip(rows, tallies, strict=True):
        assert tally.blocks == len(row.blocks(block)) > 0
        assert tally.blocks <= tally.engine_passes <= tally.passes <= tally.positions
        assert 0 < tally.answer_tokens <= tally.positions
        assert tally.first_pass_sure_right <= tally.first_pass_sure <= tally.positions
        assert tally.first_pass_argmax_right <= tally.positions
    total = grouped(tallies, rows)["all"].summary()
    assert total["cases"] == 3
    positions, ceiling = total["positions_per_pass"], total["positions_ceiling"]
    assert positions is not None and ceiling is not None and 1.0 <= positions <= ceiling
    tokens, token_ceiling = total["tokens_per_pass"], total["ceiling"]
    assert tokens is not None and token_ceiling is not None and 0 < tokens <= token_ceiling


def test_sure_where_right_commits_every_right_argmax_at_once() -> None:
    """Above any confidence (threshold 1.0: nothing is sure) the plain decode commits one position
    a pass; counting a right argmax as sure commits those positions too, so a block whose first
    pass is right everywhere takes one pass, and no block takes more passes than positions."""
    torch.set_num_threads(1)
    lm = load_checkpoint(TRAINED_CLOVER_DEMO, dtype=torch.float32)
    lm.model.eval()
    block, mask = lm.config.block_size or 4, lm.config.mask_token_id
    assert mask is not None
    eos = set(lm.tokenizer.eos_token_ids)
    rows = [gold_row(c, lm.tokenizer, block) for c in generation_cases("eval", 1, 3)]
    plain = grouped(gold_prefix_bound(lm.model, rows, block, mask, eos, 1.0), rows)["all"]
    right = grouped(gold_prefix_bound(lm.model, rows, block, mask, eos, 1.0, True), rows)["all"]
    assert plain.passes == plain.positions and plain.first_pass_sure == 0
    assert right.first_pass_argmax_right == plain.first_pass_argmax_right > 0
    assert right.passes <= right.positions - right.first_pass_argmax_right + right.blocks
    assert right.passes < plain.passes


def test_blocks_of_8_decode_one_position_a_pass_where_nothing_is_sure(tmp_path: Path) -> None:
    """The decode runs as many steps per block as the block has positions (as ``cloverq model
    eval`` does), whatever the block size: with blocks of 8 and nothing sure, the fallback commits
    one position a pass, not the two a fixed four steps per block would force."""
    torch.set_num_threads(1)
    folder = tmp_path / "demo8"
    shutil.copytree(TRAINED_CLOVER_DEMO, folder)
    reblock(folder, 8)  # as train-demo --init-from --block-size 8 does before its first step
    write_manifest(folder)
    lm = load_checkpoint(folder, dtype=torch.float32)
    lm.model.eval()
    mask = lm.config.mask_token_id
    assert lm.config.block_size == 8 and mask is not None
    rows = [gold_row(c, lm.tokenizer, 8) for c in generation_cases("eval", 1, 2)]
    plain = grouped(gold_prefix_bound(lm.model, rows, 8, mask, set(lm.tokenizer.eos_token_ids), 1.0), rows)
    assert plain["all"].positions > 8 * len(rows) // 2
    assert plain["all"].passes == plain["all"].positions
