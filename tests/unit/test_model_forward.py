"""The forward contract the sampler relies on: cache reads/appends, ragged rows, padding, stats."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.model import CacheFullError, KVCache
from worker.model.checkpoint import LoadedModel, load_checkpoint
from worker.model.demo import write_demo_checkpoint

BLOCK = 4


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "tiny", seed=0, size="tiny", arch="sdar")
    return load_checkpoint(folder)


def _tokens(b: int, t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 470, (b, t), generator=torch.Generator().manual_seed(seed))  # [B, T]
    return ids, torch.arange(t).expand(b, t)


def _cache(loaded: LoadedModel, seqs: int = 4, length: int = 64) -> KVCache:
    return KVCache(loaded.config, max_seqs=seqs, max_len=length, device="cpu", dtype=torch.float32)


def test_logits_are_float32_and_shaped(loaded: LoadedModel) -> None:
    ids, pos = _tokens(2, 8)
    logits = loaded.model(ids, pos, pos // BLOCK)
    assert logits.shape == (2, 8, loaded.config.vocab_size)
    assert logits.dtype == torch.float32


def test_cached_blocks_equal_full_forward(loaded: LoadedModel) -> None:
    ids, pos = _tokens(2, 12)
    full = loaded.model(ids, pos, pos // BLOCK)
    cache = _cache(loaded)
    slots = torch.tensor([cache.allocate(), cache.allocate()])
    outs = [
        loaded.model(
            ids[:, s : s + BLOCK],
            pos[:, s : s + BLOCK],
            pos[:, s : s + BLOCK] // BLOCK,
            cache=cache,
            slots=slots,
            commit_lens=torch.tensor([BLOCK, BLOCK]),
        )
        for s in range(0, 12, BLOCK)
    ]
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-4, rtol=0)
    assert cache.lengths[slots].tolist() == [12, 12]


def test_forward_without_commit_leaves_cache_unchanged(loaded: LoadedModel) -> None:
    ids, pos = _tokens(1, 8)
    cache = _cache(loaded)
    slots = torch.tensor([cache.allocate()])
    loaded.model(
        ids[:, :4], pos[:, :4], pos[:, :4] // BLOCK, cache=cache, slots=slots, commit_lens=torch.tensor([4])
    )
    slot = int(slots[0])
    k_before = [k[slot, :, :4].clone() for k in cache.k]  # the committed entries
    first = loaded.model(ids[:, 4:], pos[:, 4:], pos[:, 4:] // BLOCK, cache=cache, slots=slots)
    second = loaded.model(ids[:, 4:], pos[:, 4:], pos[:, 4:] // BLOCK, cache=cache, slots=slots)
    assert torch.equal(first, second)
    assert all(torch.equal(a, b[slot, :, :4]) for a, b in zip(k_before, cache.k, strict=True))
    assert cache.length(slot) == 4


def test_ragged_rows_with_padding_match_separate_forwards(loaded: LoadedModel) -> None:
    ids, pos = _tokens(2, 12, seed=3)
    cache = _cache(loaded)
    a, b = cache.allocate(), cache.allocate()
    # row a has 8 committed positions, row b has 4
    loaded.model(
        ids[:1, :8],
        pos[:1, :8],
        pos[:1, :8] // BLOCK,
        cache=cache,
        slots=torch.tensor([a]),
        commit_lens=torch.tensor([8]),
    )
    loaded.model(
        ids[1:, :4],
        pos[1:, :4],
        pos[1:, :4] // BLOCK,
        cache=cache,
        slots=torch.tensor([b]),
        commit_lens=torch.tensor([4]),
    )
    new_ids = torch.stack([ids[0, 8:12], torch.cat([ids[1, 4:7], torch.tensor([0])])])  # [2, 4]
    new_pos = torch.stack([pos[0, 8:12], torch.tensor([4, 5, 6, 0])])
    valid = torch.tensor([[True] * 4, [True, True, True, False]])
    got = loaded.model(
        new_ids,
        new_pos,
        new_pos // BLOCK,
        valid=valid,
        cache=cache,
        slots=torch.tensor([a, b]),
        commit_lens=torch.tensor([4, 3]),
    )
    ref_a = loaded.model(ids[:1], pos[:1], pos[:1] // BLOCK)[0, 8:12]
    ref_b = loaded.model(ids[1:, :7], pos[1:, :7], pos[1:, :7] // BLOCK)[0, 4:7]
    torch.testing.assert_close(got[0], ref_a, atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1, :3], ref_b, atol=1e-4, rtol=0)
    assert cache.lengths[torch.tensor([a, b])].tolist() == [12, 7]


def test_fully_padded_row_has_no_nan(loaded: LoadedModel) -> None:
    ids, pos = _tokens(2, 4)
    valid = torch.tensor([[True] * 4, [False] * 4])
    logits = loaded.model(ids, pos, pos // BLOCK, valid=valid)
    assert not torch.isnan(logits).any()
    torch.testing.assert_close(
        logits[0], loaded.model(ids[:1], pos[:1], pos[:1] // BLOCK)[0], atol=1e-4, rtol=0
    )


def test_router_counts_count_valid_tokens_per_moe_layer(loaded: LoadedModel) -> None:
    cfg = loaded.config
    ids, pos = _tokens(2, 8)
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, 5:] = False
    counts = torch.zeros(cfg.num_hidden_layers, cfg.num_experts, dtype=torch.long)
    loaded.model(ids, pos, pos // BLOCK, valid=valid, router_counts=counts)
    for layer in range(cfg.num_hidden_layers):
        expected = 13 * cfg.num_experts_per_tok if cfg.is_moe_layer(layer) else 0
        assert counts[layer].sum().item() == expected
    assert (counts[list(cfg.moe_layers)] > 0).sum() > cfg.num_experts  # routing spreads over experts


def test_cache_slots_allocate_free_and_fill_up(loaded: LoadedModel) -> None:
    cache = _cache(loaded, seqs=2, length=8)
    a, b = cache.allocate(), cache.allocate()
    assert {a, b} == {0, 1} and cache.num_free() == 0
    with pytest.raises(CacheFullError):
        cache.allocate()
    cache.free(a)
    assert cache.num_free() == 1 and cache.allocate() == a
    ids, pos = _tokens(1, 12)
    with pytest.raises(CacheFullError):
        loaded.model(
            ids, pos, pos // BLOCK, cache=cache, slots=torch.tensor([b]), commit_lens=torch.tensor([12])
        )


def test_bfloat16_forward_is_close_to_float32(tmp_path: Path, loaded: LoadedModel) -> None:
    bf16 = load_checkpoint(loaded.path, dtype=torch.bfloat16)
    ids, pos = _tokens(1, 8)
    ref = loaded.model(ids, pos, pos // BLOCK)
    got = bf16.model(ids, pos, pos // BLOCK)
    assert got.dtype == torch.float32 and not torch.isnan(got).any()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_permuted_slots_and_a_row_near_the_end_of_its_slot(loaded: LoadedModel) -> None:
    """Gathered (non-contiguous) slots, and padding that would run past ``max_len``, still match."""
    ids, pos = _tokens(2, 16, seed=5)
    cache = _cache(loaded, seqs=3, length=16)
    for _ in range(3):
        cache.allocate()
    near_end, short = 2, 0  # slots given in descending order -> gathered, not a view
    loaded.model(
        ids[:1, :12],
        pos[:1, :12],
        pos[:1, :12] // BLOCK,
        cache=cache,
        slots=torch.tensor([near_end]),
        commit_lens=torch.tensor([12]),
    )
    # row 0 decodes its last block (12..15); row 1 prefills 8 positions, so T = 8 and row 0's
    # padding (columns 16..19) has no room in its slot
    new_ids = torch.stack([torch.cat([ids[0, 12:16], torch.zeros(4, dtype=torch.long)]), ids[1, :8]])
    new_pos = torch.stack([torch.cat([pos[0, 12:16], torch.zeros(4, dtype=torch.long)]), pos[1, :8]])
    valid = torch.tensor([[True] * 4 + [False] * 4, [True] * 8])
    got = loaded.model(
        new_ids,
        new_pos,
        new_pos // BLOCK,
        valid=valid,
        cache=cache,
        slots=torch.tensor([near_end, short]),
        commit_lens=torch.tensor([4, 8]),
    )
    assert not torch.isnan(got).any()
    torch.testing.assert_close(
        got[0, :4], loaded.model(ids[:1], pos[:1], pos[:1] // BLOCK)[0, 12:16], atol=1e-4, rtol=0
    )
    torch.testing.assert_close(
        got[1], loaded.model(ids[1:, :8], pos[1:, :8], pos[1:, :8] // BLOCK)[0], atol=1e-4, rtol=0
    )
    assert cache.lengths.tolist() == [8, 0, 16]
    follow = loaded.model(
        ids[1:, 8:12], pos[1:, 8:12], pos[1:, 8:12] // BLOCK, cache=cache, slots=torch.tensor([short])
    )
    torch.testing.assert_close(
        follow[0], loaded.model(ids[1:, :12], pos[1:, :12], pos[1:, :12] // BLOCK)[0, 8:], atol=1e-4, rtol=0
    )


def test_logits_index_returns_the_selected_positions_only(loaded: LoadedModel) -> None:
    ids, pos = _tokens(2, 8)
    full = loaded.model(ids, pos, pos // BLOCK)
    index = torch.tensor([[4, 5, 6, 7], [0, 2, 2, 7]])
    picked = loaded.model(ids, pos, pos // BLOCK, logits_index=index)
    assert picked.shape == (2, 4, loaded.config.vocab_size)
    torch.testing.assert_close(picked, full.gather(1, index[..., None].expand(-1, -1, full.shape[-1])))


def test_expert_loop_fallback_matches_the_grouped_kernel(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.model import moe

    ids, pos = _tokens(2, 8)
    grouped = loaded.model(ids, pos, pos // BLOCK)
    monkeypatch.setattr(moe, "_GROUPED_MM_WORKS", {("cpu", None, torch.float32): False})
    looped = loaded.model(ids, pos, pos // BLOCK)
    torch.testing.assert_close(looped, grouped, atol=1e-5, rtol=0)


def test_a_real_position_past_the_slot_is_refused(loaded: LoadedModel) -> None:
    ids, pos = _tokens(1, 12)
    cache = _cache(loaded, seqs=1, length=8)
    slots = torch.tensor([cache.allocate()])
    loaded.model(
        ids[:, :4], pos[:, :4], pos[:, :4] // BLOCK, cache=cache, slots=slots, commit_lens=torch.tensor([4])
    )
    with pytest.raises(CacheFullError):  # positions 4..11: 8..11 have no room, even uncommitted
        loaded.model(ids[:, 4:], pos[:, 4:], pos[:, 4:] // BLOCK, cache=cache, slots=slots)
    valid = torch.tensor([[True] * 4 + [False] * 4])  # padding past the slot is simply not stored
    out = loaded.model(ids[:, 4:], pos[:, 4:], pos[:, 4:] // BLOCK, valid=valid, cache=cache, slots=slots)
    ref = loaded.model(ids[:, :8], pos[:, :8], pos[:, :8] // BLOCK)[0, 4:8]
    torch.testing.assert_close(out[0, :4], ref, atol=1e-4, rtol=0)


def test_a_bfloat16_cache_serves_a_float32_model(loaded: LoadedModel) -> None:
    ids, pos = _tokens(1, 8)
    cache = KVCache(loaded.config, max_seqs=1, max_len=16, device="cpu", dtype=torch.bfloat16)
    slots = torch.tensor([cache.allocate()])
    loaded.model(
        ids[:, :4], pos[:, :4], pos[:, :4] // BLOCK, cache=cache, slots=slots, commit_lens=torch.tensor([4])
    )
    got = loaded.model(ids[:, 4:], pos[:, 4:], pos[:, 4:] // BLOCK, cache=cache, slots=slots)
    ref = loaded.model(ids, pos, pos // BLOCK)[:, 4:]
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 0.1 * ref.abs().max().item()
