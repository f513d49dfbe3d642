"""Clover's trunk against transformers' ``Qwen3_5MoeForCausalLM`` on the same weights.

Tiny random models of several shapes are saved by transformers itself and loaded by our loader;
the causal forward, and prefill plus block-by-block commits through the hybrid cache, must give
transformers' logits within 1e-4 (fp32). The two forms of the gated delta rule must agree too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.model.checkpoint import build_empty_model, load_weights, read_config, weight_files
from worker.model.delta_rule import chunked_delta_rule, recurrent_delta_rule
from worker.model.hybrid_model import CloverHybridForBlockDiffusion

transformers = pytest.importorskip("transformers", reason="transformers: a test extra (make test)")

SHAPES: dict[str, dict[str, Any]] = {
    "kv2-ratio2-p25-int4": dict(num_key_value_heads=2, linear_num_key_heads=2, partial=0.25, interval=4),
    "kv1-ratio1-p50-int2": dict(num_key_value_heads=4, linear_num_key_heads=4, partial=0.5, interval=2),
    "kv4-ratio4-p25-int2-tied": dict(
        num_key_value_heads=1, linear_num_key_heads=1, partial=0.25, interval=2, tied=True
    ),
}
TOL = 1e-4


def _hf_model(shape: dict[str, Any], seed: int) -> Any:
    torch.manual_seed(seed)
    config = transformers.Qwen3_5MoeTextConfig(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=16,
        linear_num_key_heads=shape["linear_num_key_heads"],
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        num_experts=6,
        num_experts_per_tok=2,
        full_attention_interval=shape["interval"],
        tie_word_embeddings=shape.get("tied", False),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": shape["partial"],
        },
    )
    model = transformers.Qwen3_5MoeForCausalLM(config).eval()
    with torch.no_grad():  # move the norms, gates and decays away from their neutral init
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")):
                param.add_(torch.randn_like(param) * 0.3)
    return model


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    hf = _hf_model(SHAPES[request.param], seed=len(request.param))
    folder = tmp_path_factory.mktemp("hf") / request.param
    hf.save_pretrained(folder)
    config = read_config(folder, allow_causal_trunk=True)
    ours = build_empty_model(config, device="cpu", dtype=torch.float32)
    load_weights(ours, weight_files(folder), with_preview=False)
    return hf, ours, folder


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_transformers_writes_what_we_expect(pair: tuple[Any, Any, Path]) -> None:
    _, ours, folder = pair
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe_text"
    assert isinstance(ours, CloverHybridForBlockDiffusion)
    assert set(ours.config.layer_types) == {"linear_attention", "full_attention"}


def test_causal_logits_match_transformers(pair: tuple[Any, Any, Path]) -> None:
    hf, ours, _ = pair
    ids = _ids(2, 70)  # > one 64-token chunk of the delta rule
    pos = torch.arange(70).expand(2, -1)
    with torch.no_grad():
        ref = hf(ids).logits
    assert (ours(ids, pos, pos) - ref).abs().max().item() < TOL


def test_prefill_then_block_commits_equal_one_causal_forward(pair: tuple[Any, Any, Path]) -> None:
    hf, ours, _ = pair
    ids = _ids(2, 45, seed=1)
    pos = torch.arange(45).expand(2, -1)
    with torch.no_grad():
        ref = hf(ids).logits
    cache = ours.new_cache(max_seqs=2, max_len=64, device="cpu", dtype=torch.float32)
    slots = torch.tensor([cache.allocate(), cache.allocate()])
    pieces = []
    for lo, hi in ((0, 24), (24, 32), (32, 40), (40, 44), (44, 45)):  # prefill, then blocks of 8, 4, 1
        commit = torch.full((2,), hi - lo)
        pieces.append(
            ours(ids[:, lo:hi], pos[:, lo:hi], pos[:, lo:hi], cache=cache, slots=slots, commit_lens=commit)
        )
    assert (torch.cat(pieces, dim=1) - ref).abs().max().item() < TOL
    assert cache.lengths[slots].tolist() == [45, 45]


def test_rows_committing_different_lengths_in_one_forward(pair: tuple[Any, Any, Path]) -> None:
    """Ragged commits in one padded batch equal each row's own causal forward."""
    hf, ours, _ = pair
    lengths = [13, 5, 0]
    ids = _ids(3, 13, seed=2)
    cache = ours.new_cache(max_seqs=3, max_len=32, device="cpu", dtype=torch.float32)
    slots = torch.tensor([cache.allocate() for _ in lengths])
    valid = torch.arange(13)[None, :] < torch.tensor(lengths)[:, None]
    pos = torch.arange(13).expand(3, -1)
    got = ours(ids, pos, pos, valid=valid, cache=cache, slots=slots, commit_lens=torch.tensor(lengths))
    for row, n in enumerate(lengths[:2]):
        with torch.no_grad():
            ref = hf(ids[row : row + 1, :n]).logits[0]
        assert (got[row, :n] - ref).abs().max().item() < TOL
    assert cache.lengths[slots].tolist() == lengths


@pytest.mark.parametrize("length", [1, 3, 64, 100])
def test_chunked_and_recurrent_delta_rule_agree(length: int) -> None:
    gen = torch.Generator().manual_seed(length)
    b, h, dk, dv = 2, 3, 8, 5
    q = torch.nn.functional.normalize(torch.randn(b, h, length, dk, generator=gen), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(b, h, length, dk, generator=gen), dim=-1)
    v = torch.randn(b, h, length, dv, generator=gen)
    g = -torch.rand(b, h, length, generator=gen)
    beta = torch.rand(b, h, length, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen) * 0.3
    o1, s1 = chunked_delta_rule(q, k, v, g, beta, state, chunk=16)
    o2, s2 = recurrent_delta_rule(q, k, v, g, beta, state)
    assert (o1 - o2).abs().max().item() < 1e-5
    assert (s1 - s2).abs().max().item() < 1e-5


def test_fused_experts_and_nested_prefix_load_the_same(pair: tuple[Any, Any, Path], tmp_path: Path) -> None:
    """The other published spellings: fused expert tensors under ``model.language_model.``."""
    _, ours, folder = pair
    tensors = load_file(str(folder / "model.safetensors"))
    config = ours.config
    fused: dict[str, torch.Tensor] = {}
    for n in range(config.num_hidden_layers):
        ex = f"model.layers.{n}.mlp.experts"
        gate_up = [
            torch.cat((tensors.pop(f"{ex}.{e}.gate_proj.weight"), tensors.pop(f"{ex}.{e}.up_proj.weight")))
            for e in range(config.num_experts)
        ]
        down = [tensors.pop(f"{ex}.{e}.down_proj.weight") for e in range(config.num_experts)]
        fused[f"{ex}.gate_up_proj"] = torch.stack(gate_up)  # [E, 2I, H]
        fused[f"{ex}.down_proj"] = torch.stack(down)  # [E, H, I]
    tensors.update(fused)
    renamed = {k.replace("model.", "model.language_model.", 1): v.contiguous() for k, v in tensors.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(2, 2)  # vision and MTP: ignored
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    other = build_empty_model(
        read_config(tmp_path, allow_causal_trunk=True), device="cpu", dtype=torch.float32
    )
    load_weights(other, weight_files(tmp_path), with_preview=False)
    ids = _ids(1, 20, seed=3)
    pos = torch.arange(20)[None]
    assert torch.equal(other(ids, pos, pos), ours(ids, pos, pos))
