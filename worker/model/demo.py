"""A deterministic demo checkpoint in the published Hugging Face layout (random weights).

Two architectures: ``clover`` (the default: the Qwen3.5-MoE hybrid trunk with Clover's
block-diffusion preview tensors, ``model_type: clover_moe``) and ``sdar`` (Qwen3-MoE / SDAR-MoE).
The embedded default serves it and the tests load it, so it goes through exactly the code path a
real checkpoint does: ``config.json``, safetensors with the published tensor names,
``tokenizer.json``, ``tokenizer_config.json`` (chat template), ``generation_config.json`` and
``manifest.json``. The same seed and size always give byte-identical files.

Weights are drawn at a scale that keeps every layer's contribution comparable to the embedding
(std ``1/sqrt(fan_in)``) so that, although untrained, the model's predictions depend on context
and vary across positions instead of collapsing onto one token. Two more touches serve the same
end: the mask token's embedding is shrunk (as in a trained denoiser it carries no content, so a
masked position is driven by its context and position), and the LM-head rows of tokens that must
never be generated (mask, pad, ``<|im_start|>``) are zero so their logit never wins.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer

from worker.model.checkpoint import SINGLE_NAME
from worker.model.config import ModelConfig
from worker.model.demo_tokenizer import (
    CHAT_TEMPLATE,  # re-exported: the demo checkpoints' chat template (the trained demo's too)
    ENDOFTEXT,
    IM_END,
    IM_START,
    MASK,
    PAD,
    SPECIAL_TOKENS,
    build_demo_tokenizer,
)
from worker.model.hf_names import hf_targets
from worker.model.manifest import write_manifest

DemoSize = Literal["tiny", "small"]
DemoArch = Literal["clover", "sdar", "llada2"]
DEMO_ARCHS: tuple[str, ...] = ("clover", "sdar", "llada2")
# Clover-35B-A3B-Preview's context: the demos carry it so long prompts can be tried on them (issue 26;
# RoPE angles are computed per position, nothing is sized by it; the engine's memory is set apart)
DEMO_CONTEXT = 131_072

_LLADA2_SHAPES: dict[str, dict[str, Any]] = {
    # a dense first layer, then MoE with 4 groups of 2 experts (2 groups kept), 1 shared expert
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        shared_expert_gated=False,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=(0,),
        router_type="sigmoid_group",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        partial_rotary_factor=0.5,
        block_size=4,
        dtype=torch.float32,
    ),
    "small": dict(
        vocab_size=512,
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
        moe_intermediate_size=224,
        shared_expert_intermediate_size=224,
        shared_expert_gated=False,
        num_experts=32,
        num_experts_per_tok=4,
        mlp_only_layers=(0,),
        router_type="sigmoid_group",
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        partial_rotary_factor=0.5,
        block_size=8,
        dtype=torch.bfloat16,
    ),
}
_MODEL_TYPES = {"clover": "clover_moe", "sdar": "qwen3_moe", "llada2": "llada2_moe"}

_CLOVER_SHAPES: dict[str, dict[str, Any]] = {
    # ~0.2 M parameters: unit tests and the embedded default (GDN, attention, GDN, attention)
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=0,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        layer_types=("linear_attention", "full_attention") * 2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        partial_rotary_factor=0.25,
        block_size=4,
        dtype=torch.float32,
    ),
    # benchmarks: 8 layers in Clover's 3:1 GDN/attention pattern
    "small": dict(
        vocab_size=512,
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=0,
        moe_intermediate_size=224,
        shared_expert_intermediate_size=224,
        num_experts=32,
        num_experts_per_tok=4,
        layer_types=("linear_attention",) * 3
        + ("full_attention",)
        + ("linear_attention",) * 3
        + ("full_attention",),
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        partial_rotary_factor=0.25,
        block_size=8,
        dtype=torch.bfloat16,
    ),
}

_SHAPES: dict[str, dict[str, Any]] = {
    # ~0.6 M parameters, fp32 on disk (~2.4 MB): unit tests and the embedded default
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=(0,),
        block_size=4,
        dtype=torch.float32,
    ),
    # ~87 M total / ~19 M active parameters, bf16 on disk: benchmarks
    "small": dict(
        vocab_size=512,
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
        moe_intermediate_size=224,
        num_experts=32,
        num_experts_per_tok=4,
        mlp_only_layers=(0,),
        block_size=8,
        dtype=torch.bfloat16,
    ),
}


def demo_config(
    size: DemoSize, *, special_ids: dict[str, int], vocab_size: int | None = None, arch: DemoArch = "clover"
) -> tuple[ModelConfig, torch.dtype]:
    """The architecture of a demo size and the dtype its weights are stored in.

    ``vocab_size`` is the tokenizer's (the BPE may learn fewer merges than the size allows).
    """
    shape = dict({"clover": _CLOVER_SHAPES, "sdar": _SHAPES, "llada2": _LLADA2_SHAPES}[arch][size])
    dtype: torch.dtype = shape.pop("dtype")
    if vocab_size is not None:
        shape["vocab_size"] = vocab_size
    config = ModelConfig(
        **shape,
        norm_topk_prob=True,
        model_type=_MODEL_TYPES[arch],
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=DEMO_CONTEXT,
        tie_word_embeddings=False,
        mask_token_id=special_ids[MASK],
        eos_token_ids=(special_ids[IM_END],),
        pad_token_id=special_ids[PAD],
        bos_token_id=None,
        extra={"dtype": str(dtype).removeprefix("torch."), "use_cache": True},
    )
    return config, dtype


def random_weights(
    config: ModelConfig, *, seed: int, dtype: torch.dtype, never_generated: list[int]
) -> dict[str, torch.Tensor]:
    """Seeded random weights for every tensor ``config`` names (HF names, sorted: the same seed and
    config give the same bytes); ``never_generated`` token ids get an all-zero LM-head row.
    Public for ``worker/training/shape.py``, which draws a wider or deeper start the same way."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, target in sorted(hf_targets(config).items()):
        shape = target.shape
        leaf = name.rsplit(".", 1)[-1]
        if config.family == "clover" and name.endswith("norm.weight") and "linear_attn" not in name:
            t = torch.zeros(shape)  # zero-centred RMSNorm: the scale is 1 + w
        elif name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif leaf == "A_log":
            t = torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen))
        elif leaf == "dt_bias":
            t = torch.ones(shape)
        elif leaf == "bd_softmax_logit_scale":  # lambda: sharp enough that rows prefer neighbours
            t = torch.empty(shape).uniform_(2.0, 6.0, generator=gen)
        elif leaf == "bd_softmax_history_bias":
            t = torch.randn(shape, generator=gen) * 0.5
        elif leaf == "bd_softmax_history_c":
            t = torch.randn(shape, generator=gen) * 0.25
        elif leaf in ("weight", "conv_right_weight") and "conv" in name:  # [C, 1, K] / [C, K-1] taps
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        elif leaf == "expert_bias":  # LLaDA2's selection-only router bias
            t = torch.randn(shape, generator=gen) * 0.05
        elif name in ("model.embed_tokens.weight", "model.word_embeddings.weight"):
            t = torch.randn(shape, generator=gen)
            t[config.mask_token_id] *= 0.01
        elif name == "lm_head.weight":
            t = torch.randn(shape, generator=gen) * (2.0 / math.sqrt(config.hidden_size))
            t[never_generated] = 0.0
        else:  # [out, in] projections, router, experts
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        tensors[name] = t.to(dtype).contiguous()
    return tensors


def write_json(path: Path, data: dict[str, Any]) -> None:
    """A checkpoint's JSON file as the demo writes them (sorted keys, two-space indent, a final newline)."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_demo_checkpoint(
    path: Path | str,
    *,
    seed: int = 0,
    size: DemoSize = "tiny",
    arch: DemoArch = "clover",
    tokenizer: HFTokenizer | None = None,
) -> Path:
    """Write the demo checkpoint into folder ``path`` (created if needed) and return it.

    ``tokenizer``: a demo-layout tokenizer to use instead of the built-in one (the trained demo's,
    ``worker.training.tokenizer``); the vocabulary size follows it."""
    if size not in _SHAPES:
        raise ValueError(f"size must be one of {sorted(_SHAPES)}, not {size!r}")
    if arch not in DEMO_ARCHS:
        raise ValueError(f"arch must be one of {list(DEMO_ARCHS)}, not {arch!r}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)

    tokenizer = tokenizer or build_demo_tokenizer(_SHAPES[size]["vocab_size"])
    special_ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(t)
        if token_id is None:  # build_demo_tokenizer adds every special token
            raise RuntimeError(f"the demo tokenizer lacks {t!r}")
        special_ids[t] = token_id
    config, dtype = demo_config(
        size, special_ids=special_ids, vocab_size=tokenizer.get_vocab_size(), arch=arch
    )
    (folder / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n")
    write_json(
        folder / "tokenizer_config.json",
        {
            "added_tokens_decoder": {
                str(special_ids[t]): {
                    "content": t,
                    "special": True,
                    "normalized": False,
                    "lstrip": False,
                    "rstrip": False,
                    "single_word": False,
                }
                for t in SPECIAL_TOKENS
            },
            "bos_token": None,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": IM_END,
            "mask_token": MASK,
            "model_max_length": config.max_position_embeddings,
            "pad_token": PAD,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    write_json(folder / "config.json", config.to_hf_dict())
    write_json(
        folder / "generation_config.json",
        {
            "eos_token_id": [special_ids[IM_END], special_ids[ENDOFTEXT]],
            "pad_token_id": special_ids[PAD],
            "do_sample": False,
            "block_size": config.block_size,
            "mask_token_id": config.mask_token_id,
        },
    )
    save_file(
        random_weights(
            config, seed=seed, dtype=dtype, never_generated=[special_ids[t] for t in (MASK, PAD, IM_START)]
        ),
        str(folder / SINGLE_NAME),
        metadata={"format": "pt"},
    )
    # safetensors creates the file owner-only; make it as readable as the JSON files next to it
    (folder / SINGLE_NAME).chmod((folder / "config.json").stat().st_mode & 0o777)
    write_manifest(folder)
    return folder
