"""Clover's preview forward against a plain written-out reference of docs/models.md's formulas.

The reference recomputes everything for one sequence with per-row, per-head Python loops and no
cache: the committed prefix through the trunk's causal path (token-causal attention, the gated
delta rule token by token), then the block's rows through the preview (bidirectional attention
over prefix + block; the GDN conv with right taps, zero past the block's end; the block mixer
with its history slot). Our batched, cached model must agree within 1e-4 (fp32), and a preview
must leave every committed tensor bit for bit as it was.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worker.model.checkpoint import LoadedModel, load_checkpoint

TOL = 1e-4


@pytest.fixture(scope="module")
def clover(demo_checkpoint: Path) -> LoadedModel:
    return load_checkpoint(demo_checkpoint)


# ---- the plain reference ------------------------------------------------------------------------
def offset_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (1 + w)


def rope(x: torch.Tensor, pos: int, rot: int, theta: float) -> torch.Tensor:
    """Half-split rotation of the first ``rot`` dims of one head vector at position ``pos``."""
    out = x.clone()
    half = rot // 2
    for i in range(half):
        angle = pos / theta ** (2 * i / rot)
        a, b = x[i], x[i + half]
        out[i] = a * math.cos(angle) - b * math.sin(angle)
        out[i + half] = b * math.cos(angle) + a * math.sin(angle)
    return out


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum() + 1e-6)


def ref_attention(p: dict[str, torch.Tensor], cfg: object, h: torch.Tensor, n: int) -> torch.Tensor:
    c = cfg
    heads, kvh, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim  # type: ignore[attr-defined]
    t_all = h.shape[0]
    qg = (h @ p["q_proj.weight"].T).view(t_all, heads, 2 * d)
    k = (h @ p["k_proj.weight"].T).view(t_all, kvh, d)
    v = (h @ p["v_proj.weight"].T).view(t_all, kvh, d)
    eps, rot, theta = c.rms_norm_eps, c.rotary_dim, c.rope_theta  # type: ignore[attr-defined]
    out = torch.zeros(t_all, heads, d)
    for t in range(t_all):
        visible = range(t + 1) if t < n else range(t_all)  # commit rows causal; block rows see all
        for hq in range(heads):
            g = hq // (heads // kvh)
            q = rope(offset_norm(qg[t, hq, :d], p["q_norm.weight"], eps), t, rot, theta)
            keys = [rope(offset_norm(k[s, g], p["k_norm.weight"], eps), s, rot, theta) for s in visible]
            scores = torch.stack([q @ key for key in keys]) * d**-0.5
            weights = torch.softmax(scores, dim=0)
            out[t, hq] = sum(w * v[s, g] for w, s in zip(weights, visible, strict=True))
            out[t, hq] = out[t, hq] * torch.sigmoid(qg[t, hq, d:])
    return out.reshape(t_all, -1) @ p["o_proj.weight"].T


def ref_gdn(p: dict[str, torch.Tensor], cfg: object, h: torch.Tensor, n: int) -> torch.Tensor:
    c = cfg
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads  # type: ignore[attr-defined]
    dk, dv, kk = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim  # type: ignore[attr-defined]
    t_all, rows = h.shape[0], h.shape[0] - n
    x = h @ p["in_proj_qkv.weight"].T  # [T, C] raw rows
    z = (h @ p["in_proj_z.weight"].T).view(t_all, hv, dv)
    a, b = h @ p["in_proj_a.weight"].T, h @ p["in_proj_b.weight"].T
    w, wr = p["conv_weight"], p["conv_right_weight"]  # [C, K], [C, K-1]
    ext = torch.cat((torch.zeros(kk - 1, x.shape[1]), x[:n]))  # zero ring before position 0
    ring = ext[-(kk - 1) :]

    def split(y: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        q = y[: hk * dk].view(hk, dk)
        k = y[hk * dk : 2 * hk * dk].view(hk, dk)
        v = y[2 * hk * dk :].view(hv, dv)
        r = hv // hk
        return [unit(q[i // r]) for i in range(hv)], [unit(k[i // r]) for i in range(hv)], list(v)

    out = torch.zeros(t_all, hv, dv)
    state = [torch.zeros(dk, dv) for _ in range(hv)]
    for t in range(n):  # causal commit, token by token
        y = F.silu(sum(w[:, j] * ext[t + j] for j in range(kk)))
        qs, ks, vs = split(y)
        for i in range(hv):
            g = -torch.exp(p["A_log"][i]) * F.softplus(a[t, i] + p["dt_bias"][i])
            beta = torch.sigmoid(b[t, i])
            state[i] = torch.exp(g) * state[i]
            state[i] = state[i] + torch.outer(ks[i], beta * (vs[i] - state[i].T @ ks[i]))
            out[t, i] = state[i].T @ (qs[i] * dk**-0.5)
    block = x[n:]
    ext_b = torch.cat((ring, block))
    heads = []
    for t in range(rows):  # preview: left taps over ring ++ block, right taps zero past the end
        left = sum(w[:, j] * ext_b[t + j] for j in range(kk))
        right = sum(wr[:, d - 1] * (block[t + d] if t + d < rows else 0.0) for d in range(1, kk))
        heads.append(split(F.silu(left + right)))
    for t in range(rows):
        for i in range(hv):
            qi = heads[t][0][i]
            logits = [p["bd_logit_scale"][i] * (qi @ heads[s][1][i]) for s in range(rows)]
            hist = p["bd_history_bias"][i] + p["bd_history_c"][i] * math.log(rows / 32)
            weights = torch.softmax(torch.stack([*logits, hist]), dim=0)
            u = state[i].T @ (qi * dk**-0.5)
            out[n + t, i] = sum(weights[s] * heads[s][2][i] for s in range(rows)) + weights[rows] * u
    normed = out / torch.sqrt((out * out).mean(-1, keepdim=True) + c.rms_norm_eps)  # type: ignore[attr-defined]
    gated = normed * p["norm.weight"] * F.silu(z)
    return gated.reshape(t_all, -1) @ p["out_proj.weight"].T


def ref_moe(p: dict[str, torch.Tensor], cfg: object, h: torch.Tensor) -> torch.Tensor:
    k = cfg.num_experts_per_tok  # type: ignore[attr-defined]
    inter = p["w_down"].shape[1]
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        probs = torch.softmax(h[t] @ p["router.weight"].T, dim=0)
        top = torch.topk(probs, k)
        for weight, e in zip(top.values / top.values.sum(), top.indices.tolist(), strict=True):
            gu = h[t] @ p["w_gate_up"][e]
            out[t] += weight * ((F.silu(gu[:inter]) * gu[inter:]) @ p["w_down"][e])
        sh = F.silu(h[t] @ p["shared_expert.gate_proj.weight"].T) * (
            h[t] @ p["shared_expert.up_proj.weight"].T
        )
        out[t] += torch.sigmoid(h[t] @ p["shared_expert_gate.weight"].T) * (
            sh @ p["shared_expert.down_proj.weight"].T
        )
    return out


def reference_preview(lm: LoadedModel, prefix: list[int], block: list[int]) -> torch.Tensor:
    """Logits ``[len(block), V]`` of the block's rows after committing ``prefix`` (no cache)."""
    cfg, model = lm.config, lm.model
    params = dict(model.named_parameters())
    n = len(prefix)
    x = params["embed.weight"][torch.tensor(prefix + block)].clone()
    with torch.no_grad():
        for i in range(cfg.num_hidden_layers):
            own = {
                k.split(f"layers.{i}.", 1)[1]: v for k, v in params.items() if k.startswith(f"layers.{i}.")
            }
            mixer = {k.removeprefix("mixer."): v for k, v in own.items() if k.startswith("mixer.")}
            mlp = {k.removeprefix("mlp."): v for k, v in own.items() if k.startswith("mlp.")}
            h = offset_norm(x, own["input_norm.weight"], cfg.rms_norm_eps)
            x = x + (ref_gdn(mixer, cfg, h, n) if cfg.is_linear_layer(i) else ref_attention(mixer, cfg, h, n))
            x = x + ref_moe(mlp, cfg, offset_norm(x, own["post_attn_norm.weight"], cfg.rms_norm_eps))
        out = offset_norm(x[n:], params["norm.weight"], cfg.rms_norm_eps) @ params["lm_head.weight"].T
    return out


# ---- our model ------------------------------------------------------------------------------------
def committed_then_preview(lm: LoadedModel, prefix: list[int], block: list[int]) -> torch.Tensor:
    """Commit ``prefix`` in one forward, then preview ``block`` in another (the engine's two steps)."""
    cache = lm.model.new_cache(max_seqs=1, max_len=64, device="cpu", dtype=torch.float32)
    slots = torch.tensor([cache.allocate()])
    n, b = len(prefix), len(block)
    if n:
        pos = torch.arange(n)[None]
        lm.model(torch.tensor([prefix]), pos, pos, cache=cache, slots=slots, commit_lens=torch.tensor([n]))
    pos = torch.arange(n, n + b)[None]
    return lm.model(torch.tensor([block]), pos, pos, cache=cache, slots=slots)[0]


CASES = {
    "prefix8-block4": (list(range(30, 38)), [476, 12, 476, 476]),  # 476 = the demo's mask id
    "prefix5-block8": ([7, 300, 41, 2, 99], [3, 476, 476, 200, 476, 476, 476, 9]),
    "no-prefix-block4": ([], [11, 476, 476, 476]),  # S = 0: u = 0, the history slot still counts
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_preview_matches_the_written_out_reference(clover: LoadedModel, case: str) -> None:
    prefix, block = CASES[case]
    assert clover.config.mask_token_id == 476
    got = committed_then_preview(clover, prefix, block)
    ref = reference_preview(clover, prefix, block)
    assert (got - ref).abs().max().item() < TOL


def test_fused_commit_and_preview_equal_separate_passes(clover: LoadedModel) -> None:
    """One forward committing the prefix and previewing the block (as the engine fuses them)."""
    prefix, block = CASES["prefix5-block8"]
    cache = clover.model.new_cache(max_seqs=1, max_len=64, device="cpu", dtype=torch.float32)
    slots = torch.tensor([cache.allocate()])
    ids = torch.tensor([prefix + block])
    pos = torch.arange(ids.shape[1])[None]
    index = torch.arange(len(prefix), ids.shape[1])[None]
    fused = clover.model(
        ids, pos, pos, cache=cache, slots=slots, commit_lens=torch.tensor([len(prefix)]), logits_index=index
    )[0]
    assert (fused - reference_preview(clover, prefix, block)).abs().max().item() < TOL


def test_right_taps_and_history_slot_matter(clover: LoadedModel) -> None:
    """The operator is not the trunk: zeroing the right taps or the history slot changes the rows."""
    prefix, block = CASES["prefix8-block4"]
    base = committed_then_preview(clover, prefix, block)
    layer = next(m.mixer for m in clover.model.layers if m.linear)
    for name in ("conv_right_weight", "bd_history_bias"):
        param = getattr(layer, name)
        saved = param.detach().clone()
        with torch.no_grad():
            param.fill_(0.0 if name == "conv_right_weight" else -1e4)
        try:
            changed = committed_then_preview(clover, prefix, block)
            assert (changed - reference_preview(clover, prefix, block)).abs().max().item() < TOL
            assert (changed - base).abs().max().item() > 1e-3
        finally:
            with torch.no_grad():
                param.copy_(saved)


def test_a_preview_never_changes_the_committed_state(clover: LoadedModel) -> None:
    cache = clover.model.new_cache(max_seqs=2, max_len=64, device="cpu", dtype=torch.float32)
    slots = torch.tensor([cache.allocate(), cache.allocate()])
    ids = torch.randint(0, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12).expand(2, -1)
    clover.model(ids, pos, pos, cache=cache, slots=slots, commit_lens=torch.tensor([12, 7]))

    def committed() -> list[torch.Tensor]:
        """Every committed tensor: K/V up to each slot's length (columns past it are scratch that
        a pass may write and no later pass reads), both copies of every ring and state."""
        kv = [t[s, :, :n].clone() for t in (*cache.k, *cache.v) for s, n in zip((0, 1), (12, 7), strict=True)]
        return [*kv, *(t.clone() for t in (*cache.ring, *cache.state, cache.lengths, cache.current))]

    before = committed()
    block = torch.full((2, 4), 476)
    clover.model(block, pos[:, :4] + 12, pos[:, :4], cache=cache, slots=slots)  # preview only
    assert all(torch.equal(x, y) for x, y in zip(before, committed(), strict=True))
