"""The architecture hyper-parameters of a checkpoint, for both model families.

One frozen dataclass read from a Hugging Face ``config.json`` so the model, the loader, the state
cache and the planner agree on shapes. Two families share it:

- ``sdar``: Qwen3-MoE / SDAR-MoE (``qwen3_moe``, ``sdar_moe``, ``sdar``), every layer attention.
- ``clover``: Clover-35B-A3B-Preview (``clover_moe``), the Qwen3.5-MoE hybrid trunk (Gated DeltaNet
  and gated full-attention layers, shared expert) with block-diffusion preview tensors.

Name variants across published configs (``num_experts`` vs ``num_local_experts``, ``rope_theta`` vs
``rope_parameters.rope_theta``, a trunk nested under ``text_config``) are resolved here, once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SDAR_MODEL_TYPES: frozenset[str] = frozenset({"qwen3_moe", "sdar_moe", "sdar"})
CLOVER_MODEL_TYPES: frozenset[str] = frozenset({"clover_moe", "clover_moe_text"})
# the causal Qwen3.5-MoE trunk: readable (to check our trunk against it) but not servable
CAUSAL_TRUNK_MODEL_TYPES: frozenset[str] = frozenset({"qwen3_5_moe", "qwen3_5_moe_text"})
SUPPORTED_MODEL_TYPES: frozenset[str] = SDAR_MODEL_TYPES | CLOVER_MODEL_TYPES
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
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            raise ConfigError(f"partial_rotary_factor={self.partial_rotary_factor} gives an odd rotary width")

    # --- family and layer kinds ---------------------------------------------------------------
    @property
    def family(self) -> str:
        """``clover`` (hybrid trunk + preview operators) or ``sdar`` (all-attention Qwen3-MoE)."""
        return "clover" if self.layer_types else "sdar"

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
        """Committed GDN state of one sequence across layers: float32 ``S`` plus the conv ring."""
        per_layer = 4 * self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        ring = 4 * (self.linear_conv_kernel_dim - 1) * self.linear_conv_dim
        return len(self.linear_layers) * (per_layer + ring)

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
        shared = (
            3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        )
        total = active = 0
        for layer in range(self.num_hidden_layers):
            mixer = linear if self.is_linear_layer(layer) else attn
            total += mixer + norms
            active += mixer + norms
            if self.is_moe_layer(layer):
                router = self.num_experts * h
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
        hybrid = model_type not in SDAR_MODEL_TYPES
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
        return cls(**fields, extra={k: v for k, v in d.items() if k not in known})

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
