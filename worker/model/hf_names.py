"""Hugging Face tensor names -> our parameters: the one name mapping both loaders use.

``hf_targets`` maps every checkpoint tensor (canonical spelling: ``canonical_name``) of a
family's checkpoint to the parameter it fills (``HfTarget``), with its shape, expert slot, fused
part or q/k/v split; ``copy_into`` writes a tensor (or a tensor-parallel rank's slice of it) into
that parameter; ``unmapped_params`` names the parameters no checkpoint tensor fills. The single
device loader (``checkpoint.load_weights``) and the rank loader (``parallel/shard.py``) both walk
the checkpoint through ``checkpoint.mapped_tensors``, which applies these; the demo builder and
the trainer write checkpoints through the inverse of ``hf_targets``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from worker.model.config import ModelConfig

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
SKIPPED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")  # vision tower, MTP head: not served
_NESTED_PREFIX = "model.language_model."  # multimodal checkpoints nest the trunk here
# our GDN parameter -> the block-diffusion tensor's checkpoint name (under ...linear_attn.)
PREVIEW_TENSORS: dict[str, str] = {
    "conv_right_weight": "conv_right_weight",
    "bd_logit_scale": "bd_softmax_logit_scale",
    "bd_history_bias": "bd_softmax_history_bias",
    "bd_history_c": "bd_softmax_history_c",
}


@dataclass(frozen=True)
class HfTarget:
    """Where one checkpoint tensor goes in our model."""

    param: str  # our parameter name
    shape: tuple[int, ...]  # its shape in the checkpoint
    expert: int | None = None  # stacked expert index
    part: Literal["gate", "up", "down", "gate_up_all", "down_all"] | None = None
    also: tuple[tuple[int, ...], ...] = ()  # other accepted shapes (same elements, reshaped)
    split: tuple[tuple[str, int, int], ...] = ()  # a fused tensor: (our parameter, first row, end row)

    def params(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.split) if self.split else (self.param,)

    def accepts(self, shape: tuple[int, ...]) -> bool:
        return shape == self.shape or shape in self.also


def canonical_name(name: str) -> str:
    """One spelling for the trunk's tensor names (``model.language_model.X`` -> ``model.X``)."""
    return "model." + name[len(_NESTED_PREFIX) :] if name.startswith(_NESTED_PREFIX) else name


def hf_targets(
    config: ModelConfig, *, fused_experts: bool = False, with_preview: bool = True
) -> dict[str, HfTarget]:
    """Checkpoint tensor name (canonical spelling) -> where it lives in our model.

    ``fused_experts``: the checkpoint stores each layer's experts as two stacked tensors;
    ``with_preview``: Clover's block-diffusion tensors are required (not for a causal trunk).
    """
    if config.family == "clover":
        return _clover_targets(config, fused_experts=fused_experts, with_preview=with_preview)
    if config.family == "llada2":
        return _llada2_targets(config)
    return _sdar_targets(config)


def _shared_targets(config: ModelConfig) -> dict[str, HfTarget]:
    """Embedding, final norm, LM head and every layer's two norms: the same names in both families."""
    h = config.hidden_size
    t: dict[str, HfTarget] = {
        "model.embed_tokens.weight": HfTarget("embed.weight", (config.vocab_size, h)),
        "model.norm.weight": HfTarget("norm.weight", (h,)),
    }
    if not config.tie_word_embeddings:
        t["lm_head.weight"] = HfTarget("lm_head.weight", (config.vocab_size, h))
    for n in range(config.num_hidden_layers):
        src, dst = f"model.layers.{n}", f"layers.{n}"
        t[f"{src}.input_layernorm.weight"] = HfTarget(f"{dst}.input_norm.weight", (h,))
        t[f"{src}.post_attention_layernorm.weight"] = HfTarget(f"{dst}.post_attn_norm.weight", (h,))
    return t


def _attention_targets(config: ModelConfig, src: str, dst: str, *, q_rows: int) -> dict[str, HfTarget]:
    """One attention layer's q/k/v/o projections (and biases) and q/k norms, Qwen3 spelling:
    checkpoint module ``src`` -> our module ``dst``; ``q_rows``: the output rows of ``q_proj``."""
    h, d = config.hidden_size, config.head_dim
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    t: dict[str, HfTarget] = {}
    for name, out in (("q", q_rows), ("k", kv * d), ("v", kv * d)):
        t[f"{src}.{name}_proj.weight"] = HfTarget(f"{dst}.{name}_proj.weight", (out, h))
        if config.attention_bias:
            t[f"{src}.{name}_proj.bias"] = HfTarget(f"{dst}.{name}_proj.bias", (out,))
    t[f"{src}.o_proj.weight"] = HfTarget(f"{dst}.o_proj.weight", (h, heads * d))
    if config.attention_bias:
        t[f"{src}.o_proj.bias"] = HfTarget(f"{dst}.o_proj.bias", (h,))
    t[f"{src}.q_norm.weight"] = HfTarget(f"{dst}.q_norm.weight", (d,))
    t[f"{src}.k_norm.weight"] = HfTarget(f"{dst}.k_norm.weight", (d,))
    return t


def _sdar_targets(config: ModelConfig) -> dict[str, HfTarget]:
    """Qwen3-MoE / SDAR-MoE names -> ``BlockCausalForBlockDiffusion``."""
    heads, d = config.num_attention_heads, config.head_dim
    t = _shared_targets(config)
    for n in range(config.num_hidden_layers):
        src, dst = f"model.layers.{n}", f"layers.{n}"
        t.update(_attention_targets(config, f"{src}.self_attn", f"{dst}.attn", q_rows=heads * d))
        t.update(_moe_targets(config, n, fused=False))
    return t


def _llada2_targets(config: ModelConfig) -> dict[str, HfTarget]:
    """LLaDA2-MoE / BailingMoeV2 names -> ``BlockCausalForBlockDiffusion``.

    ``attention.query_key_value`` ``[(H + 2 KVH) * D, hidden]`` holds the query heads, then the key
    heads, then the value heads: it is split into our q/k/v projections here.
    """
    h, d = config.hidden_size, config.head_dim
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    t = _shared_targets(config)
    t["model.word_embeddings.weight"] = t.pop("model.embed_tokens.weight")
    q_rows, kv_rows = heads * d, kv * d
    for n in range(config.num_hidden_layers):
        src, dst = f"model.layers.{n}.attention", f"layers.{n}.attn"
        bounds = (
            ("q", 0, q_rows),
            ("k", q_rows, q_rows + kv_rows),
            ("v", q_rows + kv_rows, q_rows + 2 * kv_rows),
        )
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            split = tuple((f"{dst}.{name}_proj.{kind}", lo, hi) for name, lo, hi in bounds)
            shape = (q_rows + 2 * kv_rows, h) if kind == "weight" else (q_rows + 2 * kv_rows,)
            t[f"{src}.query_key_value.{kind}"] = HfTarget(split[0][0], shape, split=split)
        t[f"{src}.dense.weight"] = HfTarget(f"{dst}.o_proj.weight", (h, heads * d))
        if config.attention_bias:
            t[f"{src}.dense.bias"] = HfTarget(f"{dst}.o_proj.bias", (h,))
        t[f"{src}.query_layernorm.weight"] = HfTarget(f"{dst}.q_norm.weight", (d,))
        t[f"{src}.key_layernorm.weight"] = HfTarget(f"{dst}.k_norm.weight", (d,))
        moe = _moe_targets(config, n, fused=False)
        if config.is_moe_layer(n):  # BailingMoeV2 spells the shared expert(s) and the bias its way
            mlp, ours = f"model.layers.{n}.mlp", f"layers.{n}.mlp"
            for part in ("gate", "up", "down"):
                moe[f"{mlp}.shared_experts.{part}_proj.weight"] = moe.pop(
                    f"{mlp}.shared_expert.{part}_proj.weight"
                )
            moe[f"{mlp}.gate.expert_bias"] = HfTarget(f"{ours}.expert_bias", (config.num_experts,))
        t.update(moe)
    return t


def _clover_targets(config: ModelConfig, *, fused_experts: bool, with_preview: bool) -> dict[str, HfTarget]:
    """Qwen3.5-MoE / Clover names -> ``CloverHybridForBlockDiffusion``."""
    h, d = config.hidden_size, config.head_dim
    heads = config.num_attention_heads
    c, k = config.linear_conv_dim, config.linear_conv_kernel_dim
    hv, dv = config.linear_num_value_heads, config.linear_value_head_dim
    t = _shared_targets(config)
    for n in range(config.num_hidden_layers):
        src, dst = f"model.layers.{n}", f"layers.{n}"
        if config.is_linear_layer(n):
            la, mx = f"{src}.linear_attn", f"{dst}.mixer"
            for name, shape in (
                ("in_proj_qkv.weight", (c, h)),
                ("in_proj_z.weight", (hv * dv, h)),
                ("in_proj_a.weight", (hv, h)),
                ("in_proj_b.weight", (hv, h)),
                ("A_log", (hv,)),
                ("dt_bias", (hv,)),
                ("norm.weight", (dv,)),
                ("out_proj.weight", (h, hv * dv)),
            ):
                t[f"{la}.{name}"] = HfTarget(f"{mx}.{name}", shape)
            t[f"{la}.conv1d.weight"] = HfTarget(f"{mx}.conv_weight", (c, 1, k), also=((c, k),))
            if with_preview:
                for ours, theirs in PREVIEW_TENSORS.items():
                    shape, also = (
                        ((c, k - 1), ((c, 1, k - 1),)) if ours == "conv_right_weight" else ((hv,), ())
                    )
                    t[f"{la}.{theirs}"] = HfTarget(f"{mx}.{ours}", shape, also=also)
        else:
            # Clover's q_proj emits each head's output gate beside its query: twice the rows
            t.update(_attention_targets(config, f"{src}.self_attn", f"{dst}.mixer", q_rows=2 * heads * d))
        t.update(_moe_targets(config, n, fused_experts))
    return t


def _moe_targets(config: ModelConfig, n: int, fused: bool) -> dict[str, HfTarget]:
    """Layer ``n``'s feed-forward: router, experts (per expert or fused) and shared expert, or the
    dense MLP of a layer without experts (the same names in both families)."""
    h, e = config.hidden_size, config.num_experts
    src, dst = f"model.layers.{n}.mlp", f"layers.{n}.mlp"
    t: dict[str, HfTarget] = {}
    if not config.is_moe_layer(n):
        i = config.intermediate_size
        for name, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            t[f"{src}.{name}_proj.weight"] = HfTarget(f"{dst}.{name}_proj.weight", shape)
        return t
    i = config.moe_intermediate_size
    t[f"{src}.gate.weight"] = HfTarget(f"{dst}.router.weight", (e, h))
    if fused:
        t[f"{src}.experts.gate_up_proj"] = HfTarget(f"{dst}.w_gate_up", (e, 2 * i, h), part="gate_up_all")
        t[f"{src}.experts.down_proj"] = HfTarget(f"{dst}.w_down", (e, h, i), part="down_all")
    else:
        for x in range(e):
            ex = f"{src}.experts.{x}"
            t[f"{ex}.gate_proj.weight"] = HfTarget(f"{dst}.w_gate_up", (i, h), x, "gate")
            t[f"{ex}.up_proj.weight"] = HfTarget(f"{dst}.w_gate_up", (i, h), x, "up")
            t[f"{ex}.down_proj.weight"] = HfTarget(f"{dst}.w_down", (h, i), x, "down")
    s = config.shared_expert_intermediate_size
    if s:
        for name, shape in (("gate", (s, h)), ("up", (s, h)), ("down", (h, s))):
            t[f"{src}.shared_expert.{name}_proj.weight"] = HfTarget(
                f"{dst}.shared_expert.{name}_proj.weight", shape
            )
        if config.shared_expert_gated:
            t[f"{src}.shared_expert_gate.weight"] = HfTarget(f"{dst}.shared_expert_gate.weight", (1, h))
    return t


def fused_experts_in(names: Iterable[str]) -> bool:
    """Whether the checkpoint stores each layer's experts as two stacked tensors."""
    return any(canonical_name(n).endswith("mlp.experts.gate_up_proj") for n in names)


def unmapped_params(
    params: Mapping[str, torch.Tensor], targets: Mapping[str, HfTarget], config: ModelConfig,
    *, with_preview: bool,
) -> set[str]:
    """Parameters of the model no checkpoint tensor fills (they would stay uninitialised): not
    the LM head of a tied model, nor the preview tensors when ``with_preview`` is off."""
    preview = {n for n in params if n.rsplit(".", 1)[-1] in PREVIEW_TENSORS}
    return (
        set(params)
        - {p for t in targets.values() for p in t.params()}
        - ({"lm_head.weight"} if config.tie_word_embeddings else set())
        - (set() if with_preview else preview)
    )


def copy_into(
    params: Mapping[str, torch.Tensor], target: HfTarget, tensor: torch.Tensor, *, expert_offset: int = 0
) -> None:
    """Write checkpoint ``tensor`` (or a rank's slice of it) into the parameter(s) of ``params``
    ``target`` names; ``expert_offset``: the first expert the parameter stacks (an expert parallel
    rank holds a range)."""
    if target.split:  # e.g. LLaDA2's query_key_value -> our q/k/v projections
        for name, lo, hi in target.split:
            params[name].copy_(tensor[lo:hi])
        return
    param = params[target.param]
    if target.part is None:
        param.copy_(tensor.reshape(param.shape))  # e.g. conv1d.weight [C, 1, K] -> [C, K]
        return
    if target.part in ("gate_up_all", "down_all"):  # fused [E, out, in] -> our [E, in, out]
        param.copy_(tensor.transpose(1, 2))
        return
    assert target.expert is not None  # the per-expert parts name their expert
    e = target.expert - expert_offset
    half = param.shape[-1] // 2
    if target.part == "gate":
        param[e, :, :half].copy_(tensor.T)  # [H, I] <- [I, H]^T
    elif target.part == "up":
        param[e, :, half:].copy_(tensor.T)
    else:
        param[e].copy_(tensor.T)  # [I, H] <- [H, I]^T
