"""The architecture hyper-parameters of a checkpoint, for both model families.

One frozen dataclass read from a Hugging Face ``config.json`` so the model, the loader, the state
cache and the planner agree on shapes. Two families share it:

- ``sdar``: Qwen3-MoE / SDAR-MoE (``qwen3_moe``, ``sdar_moe``, ``sdar``), every layer attention.
- ``clover``: Clover-35B-A3B-Preview (``clover_moe``), the Qwen3.5-MoE hybrid trunk (Gated DeltaNet
  and gated full-attention layers, shared expert) with block-diffusion preview tensors.
- ``llada2``: LLaDA2.0/2.1-MoE (``llada2_moe``, BailingMoeV2), every layer attention under the
  block-causal mask like SDAR, with a sigmoid group-limited router and shared experts.

Name variants across published configs (``num_experts`` vs ``num_local_experts``, ``rope_theta`` vs
``rope_parameters.rope_theta``, a trunk nested under ``text_config``) are resolved here, once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from scheduler.fleet.sequence_memory import GDN_STATE_COPIES, SequenceMemory, gdn_state_bytes

SDAR_MODEL_TYPES: frozenset[str] = frozenset({"qwen3_moe", "sdar_moe", "sdar"})
CLOVER_MODEL_TYPES: frozenset[str] = frozenset({"clover_moe", "clover_moe_text"})
# the causal Qwen3.5-MoE trunk: readable (to check our trunk against it) but not servable
CAUSAL_TRUNK_MODEL_TYPES: frozenset[str] = frozenset({"qwen3_5_moe", "qwen3_5_moe_text"})
LLADA2_MODEL_TYPES: frozenset[str] = frozenset({"llada2_moe"})
SUPPORTED_MODEL_TYPES: frozenset[str] = SDAR_MODEL_TYPES | CLOVER_MODEL_TYPES | LLADA2_MODEL_TYPES
SOFTMAX_ROUTER = "softmax"  # Qwen3 / Qwen3.5: softmax over experts, top-k
SIGMOID_GROUP_ROUTER = "sigmoid_group"  # BailingMoeV2: sigmoid scores, group-limited top-k
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


class ConfigError(ValueError):
    """config.json describes something this model cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of one checkpoint (the in-memory model is built from this alone)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # dense (non-MoE) feed-forward width
    moe_intermediate_size: int  # per-expert feed-forward width
    num_experts: int  # 0 = every layer dense
    num_experts_per_tok: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    model_type: str = "qwen3_moe"
    # block diffusion extras (absent from plain Qwen3-MoE configs)
    mask_token_id: int | None = None
    block_size: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    # hybrid (Clover / Qwen3.5-MoE) trunk; empty/zero for the all-attention SDAR family
    layer_types: tuple[str, ...] = ()  # per layer: "linear_attention" or "full_attention"
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    shared_expert_intermediate_size: int = 0
    partial_rotary_factor: float = 1.0
    # routing (LLaDA2 / BailingMoeV2: sigmoid scores, a selection-only bias, expert groups)
    router_type: str = SOFTMAX_ROUTER
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True  # Qwen3.5's shared expert has a sigmoid gate; LLaDA2's none
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} with {self.num_experts} experts"
            )
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act={self.hidden_act!r} is not supported (only 'silu')")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ConfigError(
                    f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
                )
            unknown = set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}
            if unknown:
                raise ConfigError(f"layer_types has unsupported entries: {sorted(unknown)}")
            if self.linear_num_value_heads % max(self.linear_num_key_heads, 1):
                raise ConfigError(
                    f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                    f"linear_num_key_heads={self.linear_num_key_heads}"
                )
        if self.router_type not in (SOFTMAX_ROUTER, SIGMOID_GROUP_ROUTER):
            raise ConfigError(f"router_type={self.router_type!r} is not supported")
        if self.num_experts and (self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group):
            groups = f"n_group={self.n_group}, topk_group={self.topk_group}"
            raise ConfigError(f"{groups} do not fit {self.num_experts} experts")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            raise ConfigError(f"partial_rotary_factor={self.partial_rotary_factor} gives an odd rotary width")

    # --- family and layer kinds ---------------------------------------------------------------
    @property
    def family(self) -> str:
        """``clover`` (hybrid trunk + preview operators), ``llada2`` (BailingMoeV2) or ``sdar``."""
        if self.layer_types:
            return "clover"
        return "llada2" if self.model_type in LLADA2_MODEL_TYPES else "sdar"

    def is_linear_layer(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR_ATTENTION

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers that keep K/V per committed position (every layer for SDAR)."""
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_linear_layer(i))

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Gated DeltaNet layers: a conv ring and a recurrent state per sequence."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_linear_layer(i))

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that RoPE rotates (``partial_rotary_factor`` x head_dim)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the GDN ``in_proj_qkv`` output and its depthwise conv (q, k, v)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )

    def gdn_state_bytes(self) -> int:
        """Committed GDN state of one sequence across layers (one copy): float32 ``S`` plus the conv ring."""
        if not self.linear_layers:
            return 0
        return gdn_state_bytes(
            layers=len(self.linear_layers), value_heads=self.linear_num_value_heads,
            key_head_dim=self.linear_key_head_dim, value_head_dim=self.linear_value_head_dim,
            conv_channels=self.linear_conv_dim, conv_kernel=self.linear_conv_kernel_dim)

    def sequence_memory(self, kv_element_bytes: float) -> SequenceMemory:
        """What one sequence holds in a worker (K/V per position of the attention layers, both
        cached copies of the GDN state): the formula the planner and the API share."""
        return SequenceMemory(attention_layers=len(self.attention_layers), kv_heads=self.num_key_value_heads,
                              head_dim=self.head_dim, kv_element_bytes=kv_element_bytes,
                              state_bytes=GDN_STATE_COPIES * self.gdn_state_bytes())

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a routed-expert feed-forward (Qwen3-MoE's rule)."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def kv_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    # --- parameter counts (the planner and the demo sizes use these) --------------------------
    def param_counts(self) -> tuple[int, int]:
        """``(total, active)`` parameter counts; active counts top-k experts per MoE layer."""
        h, d = self.hidden_size, self.head_dim
        gated = 2 if self.family == "clover" else 1  # Clover's q_proj also emits the output gate
        attn = h * d * ((1 + gated) * self.num_attention_heads + 2 * self.num_key_value_heads) + 2 * d
        if self.attention_bias:
            attn += d * (gated * self.num_attention_heads + 2 * self.num_key_value_heads) + h
        c, hv, dv, k = (
            self.linear_conv_dim,
            self.linear_num_value_heads,
            self.linear_value_head_dim,
            (self.linear_conv_kernel_dim),
        )
        # in_proj_qkv, in_proj_z, in_proj_a/b, conv (left and right taps), A_log, dt_bias, the
        # three block-mixer vectors, gated norm, out_proj
        linear = h * c + h * hv * dv + 2 * h * hv + c * (2 * k - 1) + 5 * hv + dv + hv * dv * h
        norms = 2 * h
        dense_ffn = 3 * h * self.intermediate_size
        expert = 3 * h * self.moe_intermediate_size
        shared_gate = h if self.shared_expert_gated else 0
        shared = 3 * h * self.shared_expert_intermediate_size + shared_gate
        shared = shared if self.shared_expert_intermediate_size else 0
        total = active = 0
        for layer in range(self.num_hidden_layers):
            mixer = linear if self.is_linear_layer(layer) else attn
            total += mixer + norms
            active += mixer + norms
            if self.is_moe_layer(layer):
                router = self.num_experts * (h + (self.router_type == SIGMOID_GROUP_ROUTER))  # + bias
                total += router + self.num_experts * expert + shared
                active += router + self.num_experts_per_tok * expert + shared
            else:
                total += dense_ffn
                active += dense_ffn
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        total += embed + head + h
        active += head + h + (self.vocab_size * h if self.tie_word_embeddings else 0)
        return total, active

    # --- Hugging Face config.json ---------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, allow_causal_trunk: bool = False) -> ModelConfig:
        """Read a Hugging Face ``config.json`` dict (Qwen3-MoE / SDAR-MoE / Clover naming).

        ``allow_causal_trunk`` also reads a plain ``qwen3_5_moe`` config (no preview operators) as
        the Clover trunk: only to check our causal path against transformers, never to serve.
        """
        model_type = d.get("model_type", "qwen3_moe")
        if model_type in CAUSAL_TRUNK_MODEL_TYPES and not allow_causal_trunk:
            raise ConfigError(
                f"model_type={model_type!r} is the causal Qwen3.5-MoE trunk without Clover's "
                "block-diffusion preview operators: it is not a diffusion model and cannot be served "
                "(a Clover checkpoint has model_type 'clover_moe')"
            )
        if model_type not in SUPPORTED_MODEL_TYPES | CAUSAL_TRUNK_MODEL_TYPES:
            raise ConfigError(f"model_type={model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}")
        hybrid = model_type in CLOVER_MODEL_TYPES | CAUSAL_TRUNK_MODEL_TYPES
        if hybrid and isinstance(d.get("text_config"), dict):  # multimodal wrapper: the trunk is nested
            outer = {k: v for k, v in d.items() if k != "text_config"}
            d = {**outer, **d["text_config"], "model_type": model_type}
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_type={rope_type!r} is not supported (only 'default')")
        rope_theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        num_experts = d.get("num_experts", d.get("num_local_experts", 0)) or 0
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        layers = int(d["num_hidden_layers"])
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        hybrid_fields: dict[str, Any] = {}
        if hybrid:
            layer_types = d.get("layer_types")
            if not layer_types:
                interval = int(d.get("full_attention_interval", 4))
                layer_types = [
                    FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)
                ]
            partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
            hybrid_fields = dict(
                layer_types=tuple(str(t) for t in layer_types),
                linear_num_key_heads=int(d.get("linear_num_key_heads", 16)),
                linear_num_value_heads=int(d.get("linear_num_value_heads", 32)),
                linear_key_head_dim=int(d.get("linear_key_head_dim", 128)),
                linear_value_head_dim=int(d.get("linear_value_head_dim", 128)),
                linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim", 4)),
                shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size", 0)),
                partial_rotary_factor=float(partial),
                norm_topk_prob=True,  # the Qwen3.5-MoE router always renormalises its top-k
            )
        known = {f for f in cls.__dataclass_fields__}
        fields: dict[str, Any] = dict(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(d.get("intermediate_size", 0) or 0),
            moe_intermediate_size=int(d.get("moe_intermediate_size", 0)),
            num_experts=int(num_experts),
            num_experts_per_tok=int(d.get("num_experts_per_tok", 0)),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=int(d.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            attention_bias=bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            hidden_act=str(d.get("hidden_act", "silu")),
            model_type=model_type,
            mask_token_id=d.get("mask_token_id"),
            block_size=d.get("block_size"),
            eos_token_ids=eos_ids,
            pad_token_id=d.get("pad_token_id"),
            bos_token_id=d.get("bos_token_id"),
        )
        fields.update(hybrid_fields)
        if model_type in LLADA2_MODEL_TYPES:
            fields.update(_llada2_fields(d, rope))
        config = cls(**fields, extra={k: v for k, v in d.items() if k not in known})
        refuse_unsupported_flags(d, family=config.family)
        return config

    def _llada2_hf_dict(self, d: dict[str, Any]) -> dict[str, Any]:
        """BailingMoeV2's spelling of the fields ``_llada2_fields`` reads."""
        for name in ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim", "shared_expert_intermediate_size",
                     "mlp_only_layers", "decoder_sparse_step", "router_type", "shared_expert_gated",
                     "norm_topk_prob", "attention_bias"):  # fmt: skip
            d.pop(name)
        d["architectures"] = ["LLaDA2MoeModelLM"]
        d["first_k_dense_replace"] = len(self.mlp_only_layers)
        d["num_shared_experts"] = self.shared_expert_intermediate_size // max(self.moe_intermediate_size, 1)
        d["use_qkv_bias"] = d["use_bias"] = self.attention_bias
        d["use_qk_norm"] = True
        d["rope_theta"] = self.rope_theta
        return d

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict that ``from_hf_dict`` reads back and whose trunk transformers'
        ``Qwen3MoeForCausalLM`` (SDAR) or ``Qwen3_5MoeForCausalLM`` (Clover) builds."""
        d = asdict(self)
        d.pop("extra")
        eos = d.pop("eos_token_ids")
        d["eos_token_id"] = eos[0] if len(eos) == 1 else (list(eos) or None)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        hybrid = (
            "layer_types",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
            "shared_expert_intermediate_size",
            "partial_rotary_factor",
        )
        if self.family == "llada2":
            d = self._llada2_hf_dict(d)
            d.update(self.extra)
            return d
        if self.family == "clover":
            d["architectures"] = ["CloverMoeModelLM"]
            d["layer_types"] = list(self.layer_types)
            rope["partial_rotary_factor"] = d.pop("partial_rotary_factor")
            for name in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "intermediate_size"):
                d.pop(name)
        else:
            d["architectures"] = ["Qwen3MoeForCausalLM"]
            for name in hybrid:
                d.pop(name)
        d["rope_parameters"] = rope
        d.update(self.extra)
        return d


def _llada2_fields(d: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """LLaDA2-MoE (BailingMoeV2) names: dense first layers, shared experts, the grouped sigmoid router."""
    if d.get("use_qk_norm", True) is False:
        raise ConfigError("use_qk_norm=false is not supported (LLaDA2's query/key layernorms are always on)")
    if bool(d.get("use_bias", False)) != bool(d.get("use_qkv_bias", False)):
        raise ConfigError("use_bias and use_qkv_bias must agree (one bias flag for q/k/v and the output)")
    shared = int(d.get("num_shared_experts") or 0)
    return dict(
        router_type=SIGMOID_GROUP_ROUTER,
        n_group=int(d.get("n_group") or 1),
        topk_group=int(d.get("topk_group") or 1),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        shared_expert_gated=False,
        shared_expert_intermediate_size=shared * int(d.get("moe_intermediate_size", 0)),
        mlp_only_layers=tuple(range(int(d.get("first_k_dense_replace", 0) or 0))),
        norm_topk_prob=True,  # the gate normalises its top-k weights (when k > 1)
        partial_rotary_factor=float(d.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))),
        attention_bias=bool(d.get("use_qkv_bias", False)),
    )


# --- config flags that change the math and are not implemented -----------------------------------


def _rope_type(value: Any) -> str:
    return str(value.get("rope_type", value.get("type", "default"))) if isinstance(value, dict) else "default"


def _is_set(value: Any) -> bool:
    return value is not None


@dataclass(frozen=True)
class RefusedFlag:
    """A ``config.json`` key whose value (when ``refused(value)``) asks for math cloverq lacks."""

    key: str
    refused: Callable[[Any], bool]
    reason: str
    families: tuple[str, ...] = ()  # () = every family


# Checked by ``from_hf_dict`` on the (flattened) config: a checkpoint that needs any of these is
# refused at load, naming the key and its value, instead of being served with different math.
REFUSED_FLAGS: tuple[RefusedFlag, ...] = (
    RefusedFlag("use_sliding_window", bool, "sliding-window attention is not implemented"),
    RefusedFlag("rope_scaling", lambda v: v is not None and _rope_type(v) != "default",
                "only the default RoPE is implemented (no yarn/linear/dynamic/llama3 scaling)"),
    RefusedFlag("dual_chunk_attention_config", _is_set, "dual chunk attention is not implemented"),
    RefusedFlag("attn_logit_softcapping", _is_set, "attention logit soft-capping is not implemented"),
    RefusedFlag("final_logit_softcapping", _is_set, "final logit soft-capping is not implemented"),
    RefusedFlag("mlp_bias", bool, "biases in the feed-forward layers are not implemented"),
    RefusedFlag("qk_layernorm", lambda v: v is False, "the attention layers always apply query/key RMSNorm"),
    RefusedFlag("use_qk_norm", lambda v: v is False, "the attention layers always apply query/key RMSNorm"),
    RefusedFlag("partial_rotary_factor", lambda v: v is not None and float(v) != 1.0,
                "SDAR-MoE rotates whole heads (partial RoPE is implemented for Clover only)", ("sdar",)),
    RefusedFlag("shared_expert_intermediate_size", bool, "SDAR-MoE (Qwen3-MoE) has no shared expert",
                ("sdar",)),
    RefusedFlag("layer_types", lambda v: any(t != FULL_ATTENTION for t in v or ()),
                "SDAR-MoE layers are all full attention", ("sdar",)),
    RefusedFlag("norm_topk_prob", lambda v: v is False,
                "the Qwen3.5-MoE router always renormalises its top-k weights", ("clover",)),
)


def refuse_unsupported_flags(d: dict[str, Any], *, family: str) -> None:
    """Raise ``ConfigError`` naming every ``REFUSED_FLAGS`` entry that ``d`` sets."""
    found = [
        f"{flag.key}={json.dumps(d[flag.key])} ({flag.reason})"
        for flag in REFUSED_FLAGS
        if flag.key in d and (not flag.families or family in flag.families) and flag.refused(d[flag.key])
    ]
    if found:
        raise ConfigError("unsupported config: " + "; ".join(found))
