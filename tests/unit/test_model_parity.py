"""Our model against transformers' Qwen3MoeForCausalLM on the same saved weights (float32).

Random tiny Qwen3-MoE models of several shapes are saved with ``save_pretrained`` (single file and
sharded), loaded with our loader, and must give the same logits under the causal mask and under
the block-causal mask (passed to transformers as a 4D additive mask).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers: a test extra (make test)")

from worker.model.block_causal_model import BlockCausalForBlockDiffusion  # noqa: E402
from worker.model.checkpoint import build_empty_model, load_weights, read_config, weight_files  # noqa: E402
from worker.model.kv_cache import KVCache  # noqa: E402

TOL = 1e-4

SHAPES: dict[str, dict[str, object]] = {
    "gqa1-top1-norm-tied": dict(
        num_attention_heads=2, num_key_value_heads=2, num_experts_per_tok=1, norm_topk_prob=True,
        tie_word_embeddings=True, mlp_only_layers=[],
    ),
    "gqa2-top2-nonorm-dense0": dict(
        num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, norm_topk_prob=False,
        tie_word_embeddings=False, mlp_only_layers=[0],
    ),
    "gqa4-top4-norm-dense1-untied": dict(
        num_attention_heads=8, num_key_value_heads=2, num_experts_per_tok=4, norm_topk_prob=True,
        tie_word_embeddings=False, mlp_only_layers=[1],
    ),
    "gqa2-top2-sparse-step2-tied": dict(
        num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, norm_topk_prob=False,
        tie_word_embeddings=True, mlp_only_layers=[], decoder_sparse_step=2,
    ),
}  # fmt: skip


def _hf_model(shape: dict[str, object], seed: int) -> transformers.Qwen3MoeForCausalLM:
    config = transformers.Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        head_dim=8,
        num_experts=6,
        max_position_embeddings=256,
        rope_theta=10000.0,
        attn_implementation="sdpa",
        **shape,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # default init gives near-uniform routing; widen it so top-k choices matter
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    return model


def _ours(folder: Path) -> BlockCausalForBlockDiffusion:
    config = read_config(folder)
    model = build_empty_model(config, device="cpu", dtype=torch.float32)
    load_weights(model, weight_files(folder))
    return model


def _block_causal_additive(t: int, block: int) -> torch.Tensor:  # [1, 1, T, T] float
    blocks = torch.arange(t) // block
    allowed = blocks[None, :] <= blocks[:, None]
    return torch.zeros(t, t).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    hf = _hf_model(SHAPES[request.param], seed=len(request.param))
    folder = tmp_path_factory.mktemp(f"hf-{request.param}")
    hf.save_pretrained(folder)
    return hf, _ours(folder), folder


def _inputs(t: int = 13, b: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (b, t), generator=gen)  # [B, T]
    return ids, torch.arange(t).expand(b, t)


def test_causal_logits_match_transformers(pair) -> None:
    hf, ours, _ = pair
    ids, pos = _inputs()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    got = ours(ids, pos, pos)  # block id = position -> plain causal
    assert (got - ref).abs().max().item() < TOL


@pytest.mark.parametrize("block", [2, 4])
def test_block_causal_logits_match_transformers_4d_mask(pair, block: int) -> None:
    hf, ours, _ = pair
    ids, pos = _inputs()
    mask = _block_causal_additive(ids.shape[1], block).expand(ids.shape[0], 1, -1, -1)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    got = ours(ids, pos, pos // block)
    assert (got - ref).abs().max().item() < TOL
    causal = ours(ids, pos, pos)
    assert (got - causal).abs().max().item() > 1e-3  # the block mask really changes the result


def test_cached_block_by_block_equals_full_forward(pair) -> None:
    _, ours, _ = pair
    block = 4
    ids, pos = _inputs(t=16)
    full = ours(ids, pos, pos // block)
    cache = KVCache(ours.config, max_seqs=3, max_len=32, device="cpu", dtype=torch.float32)
    slots = torch.tensor([cache.allocate(), cache.allocate()])
    parts = []
    for start in range(0, 16, block):
        sl = slice(start, start + block)
        parts.append(
            ours(ids[:, sl], pos[:, sl], pos[:, sl] // block, cache=cache, slots=slots,
                 commit_lens=torch.full((2,), block))
        )  # fmt: skip
    assert (torch.cat(parts, dim=1) - full).abs().max().item() < TOL
    assert cache.lengths[slots].tolist() == [16, 16]


def test_sharded_checkpoint_loads_the_same(pair, tmp_path: Path) -> None:
    hf, ours, _ = pair
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(weight_files(tmp_path)) > 1
    sharded = _ours(tmp_path)
    ids, pos = _inputs()
    assert torch.equal(sharded(ids, pos, pos), ours(ids, pos, pos))
