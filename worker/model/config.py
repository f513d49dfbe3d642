"""The architecture hyper-parameters of a Qwen3-MoE / SDAR-MoE checkpoint.

One frozen dataclass read from a Hugging Face ``config.json`` so the model, the loader, the KV
cache and the planner agree on shapes. Name variants across published configs (``num_experts`` vs
``num_local_experts``, ``rope_theta`` vs ``rope_parameters.rope_theta``) are resolved here, once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES: frozenset[str] = frozenset({"qwen3_moe", "sdar_moe", "sdar"})


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
        attn = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads) + 2 * d
        if self.attention_bias:
            attn += d * (self.num_attention_heads + 2 * self.num_key_value_heads) + h  # q, k, v, o biases
        norms = 2 * h
        dense_ffn = 3 * h * self.intermediate_size
        expert = 3 * h * self.moe_intermediate_size
        total = active = 0
        for layer in range(self.num_hidden_layers):
            total += attn + norms
            active += attn + norms
            if self.is_moe_layer(layer):
                router = self.num_experts * h
                total += router + self.num_experts * expert
                active += router + self.num_experts_per_tok * expert
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
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face ``config.json`` dict (Qwen3-MoE or SDAR-MoE naming)."""
        model_type = d.get("model_type", "qwen3_moe")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type={model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_type={rope_type!r} is not supported (only 'default')")
        rope_theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        num_experts = d.get("num_experts", d.get("num_local_experts", 0)) or 0
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        known = {f for f in cls.__dataclass_fields__}
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(d.get("intermediate_size", 0)),
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
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict that both transformers' Qwen3-MoE and ``from_hf_dict`` read."""
        d = asdict(self)
        d.pop("extra")
        eos = d.pop("eos_token_ids")
        d["eos_token_id"] = eos[0] if len(eos) == 1 else (list(eos) or None)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        d["architectures"] = ["Qwen3MoeForCausalLM"]
        d["rope_parameters"] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        d.update(self.extra)
        return d
