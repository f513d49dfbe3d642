"""LLaDA2-MoE (BailingMoeV2) against a plain reference of its public modeling math.

The reference reads the checkpoint's own tensors (fused ``query_key_value``, ``attention.dense``,
``word_embeddings``, query/key layernorms, the router's ``expert_bias``, ``shared_experts``) and
recomputes the block-causal forward with per-token Python loops: partial RoPE; a sigmoid router
whose bias only selects, group-limited top-k (the ``topk_group`` best of ``n_group`` groups by the
sum of their two best biased scores), weights = unbiased scores renormalised, times
``routed_scaling_factor``; shared experts added; the first ``first_k_dense_replace`` layers dense.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from worker.model.checkpoint import LoadedModel, load_checkpoint
from worker.model.demo import write_demo_checkpoint
from worker.model.family import decoding_defaults

TOL = 1e-4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("llada2") / "tiny", seed=3, arch="llada2")


@pytest.fixture(scope="module")
def llada2(folder: Path) -> LoadedModel:
    return load_checkpoint(folder)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rotate(x: torch.Tensor, pos: int, rot: int, theta: float) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    angle = torch.cat((pos * inv, pos * inv)).float()
    part = x[:rot]
    half = torch.cat((-part[rot // 2 :], part[: rot // 2]))
    return torch.cat((part * angle.cos() + half * angle.sin(), x[rot:]))


def swiglu(x: torch.Tensor, t: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    gate, up, down = (t[f"{prefix}.{p}_proj.weight"] for p in ("gate", "up", "down"))
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def reference_logits(folder: Path, ids: list[int], block: int) -> torch.Tensor:
    """Block-causal logits ``[T, V]`` of ``ids`` from the checkpoint files alone."""
    cfg = json.loads((folder / "config.json").read_text())
    t = load_file(str(folder / "model.safetensors"))
    eps, heads, kvh, d = (
        cfg["rms_norm_eps"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    rot = int(d * cfg["partial_rotary_factor"])
    n = len(ids)
    x = t["model.word_embeddings.weight"][torch.tensor(ids)].clone()
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        h = rms(x, t[f"{p}.input_layernorm.weight"], eps)
        qkv = (h @ t[f"{p}.attention.query_key_value.weight"].T).view(n, heads + 2 * kvh, d)
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kvh], qkv[:, heads + kvh :]
        out = torch.zeros(n, heads, d)
        for i in range(n):
            visible = [j for j in range(n) if j // block <= i // block]
            for hq in range(heads):
                g = hq // (heads // kvh)
                qi = rotate(
                    rms(q[i, hq], t[f"{p}.attention.query_layernorm.weight"], eps), i, rot, cfg["rope_theta"]
                )
                k_norm = t[f"{p}.attention.key_layernorm.weight"]
                keys = [rotate(rms(k[j, g], k_norm, eps), j, rot, cfg["rope_theta"]) for j in visible]
                w = torch.softmax(torch.stack([qi @ key for key in keys]) / math.sqrt(d), dim=0)
                out[i, hq] = sum(wj * v[j, g] for wj, j in zip(w, visible, strict=True))
        x = x + out.reshape(n, -1) @ t[f"{p}.attention.dense.weight"].T
        h = rms(x, t[f"{p}.post_attention_layernorm.weight"], eps)
        if layer < cfg["first_k_dense_replace"]:
            x = x + swiglu(h, t, f"{p}.mlp")
            continue
        mlp = torch.zeros_like(h)
        e, groups, keep = cfg["num_experts"], cfg["n_group"], cfg["topk_group"]
        for i in range(n):
            scores = torch.sigmoid(h[i] @ t[f"{p}.mlp.gate.weight"].T)
            biased = scores + t[f"{p}.mlp.gate.expert_bias"]
            group_best = [
                sorted(biased[g * (e // groups) : (g + 1) * (e // groups)].tolist())[-2:]
                for g in range(groups)
            ]
            chosen_groups = sorted(range(groups), key=lambda g: -sum(group_best[g]))[:keep]
            allowed = [x_ for x_ in range(e) if x_ // (e // groups) in chosen_groups]
            top = sorted(allowed, key=lambda x_: -biased[x_].item())[: cfg["num_experts_per_tok"]]
            weights = scores[top] / scores[top].sum() * cfg["routed_scaling_factor"]
            for wx, expert in zip(weights, top, strict=True):
                mlp[i] += wx * swiglu(h[i], t, f"{p}.mlp.experts.{expert}")
            mlp[i] += swiglu(h[i], t, f"{p}.mlp.shared_experts")
        x = x + mlp
    return rms(x, t["model.norm.weight"], eps) @ t["lm_head.weight"].T


@pytest.mark.parametrize("block", [4, 3])
def test_block_causal_logits_match_the_reference(llada2: LoadedModel, folder: Path, block: int) -> None:
    ids = [5, 17, 99, 3, 250, 41, 7, 300, 12, 8, 476]
    pos = torch.arange(len(ids))[None]
    ours = llada2.model(torch.tensor([ids]), pos, pos // block)[0]
    assert (ours - reference_logits(folder, ids, block)).abs().max().item() < TOL


def test_config_reads_the_bailing_names(llada2: LoadedModel) -> None:
    c = llada2.config
    assert c.family == "llada2" and c.mlp_only_layers == (0,) and c.rotary_dim == 8
    assert (c.router_type, c.n_group, c.topk_group, c.routed_scaling_factor) == ("sigmoid_group", 4, 2, 2.5)
    defaults = decoding_defaults(c)
    assert (defaults.strategy, defaults.threshold, defaults.steps_for(32)) == ("dynamic", 0.95, 32)
    total, _ = c.param_counts()
    assert total == sum(p.numel() for p in llada2.model.parameters())
