"""Checkpoint folders as a new user downloads them: written by transformers' ``save_pretrained``.

One builder per model family (``BUILDERS``; a third family adds one entry). Each writes what a
Hugging Face download holds and nothing cloverq adds: sharded ``*.safetensors`` with an index,
``config.json`` (no ``block_size``, no ``mask_token_id``), transformers' ``generation_config.json``,
and the demo tokenizer saved by transformers (``tokenizer.json``, a ``tokenizer_config.json``
without a template, ``chat_template.jinja``). No ``manifest.json``.

- ``clover``: ``Qwen3_5MoeForCausalLM`` with ``model_type`` rewritten to ``clover_moe`` and the four
  block-diffusion tensors added per Gated DeltaNet layer (shapes as in worker/model/demo.py);
- ``sdar``: ``Qwen3MoeForCausalLM`` as it is (``qwen3_moe``);
- ``llada2``: transformers has no BailingMoeV2 class, so the shards are written in its published
  names (``word_embeddings``, fused ``query_key_value``, ``gate.expert_bias``, ``shared_experts``)
  with safetensors directly, in the same layout (index, shards, no manifest).

The vocabulary is larger than the tokenizer's (64 Ki rows, as real checkpoints pad it) so that the
shards are tens of MB: large enough that a sampled manifest check visibly reads a small part. The
LM-head rows past the tokenizer's ids are zero (padding rows never win), so the text is not empty.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

VOCAB = 65536
SHARD = "16MB"  # embedding and LM head land in shards of their own


def _common() -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )


def _save(model: Any, folder: Path) -> None:
    """``model`` and the demo tokenizer, both by transformers' ``save_pretrained``."""
    import transformers

    from worker.model.demo_tokenizer import CHAT_TEMPLATE, IM_END, MASK, PAD, build_demo_tokenizer

    backend = build_demo_tokenizer(512)
    with torch.no_grad():
        model.lm_head.weight[backend.get_vocab_size() :] = 0.0
    model.save_pretrained(folder, max_shard_size=SHARD)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=IM_END, pad_token=PAD, mask_token=MASK
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)


def _index(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / "model.safetensors.index.json").read_text()))


def build_clover(folder: Path, *, seed: int = 0) -> Path:
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    config = transformers.Qwen3_5MoeTextConfig(
        **_common(),
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        shared_expert_intermediate_size=32,
        full_attention_interval=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
    )
    _save(transformers.Qwen3_5MoeForCausalLM(config), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "clover_moe"
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    # the block-diffusion tensors, appended to the last shard (as the published checkpoint ships them)
    index = _index(folder)
    last = sorted(set(index["weight_map"].values()))[-1]
    tensors = load_file(str(folder / last))
    conv = 2 * 2 * 16 + 4 * 16  # linear_conv_dim
    gen = torch.Generator().manual_seed(seed + 1)
    for n, kind in enumerate(cfg["layer_types"]):
        if kind != "linear_attention":
            continue
        base = f"model.layers.{n}.linear_attn"
        extra = {
            f"{base}.conv_right_weight": torch.randn(conv, 3, generator=gen) / math.sqrt(3),
            f"{base}.bd_softmax_logit_scale": torch.empty(4).uniform_(2.0, 6.0, generator=gen),
            f"{base}.bd_softmax_history_bias": torch.randn(4, generator=gen) * 0.5,
            f"{base}.bd_softmax_history_c": torch.randn(4, generator=gen) * 0.25,
        }
        tensors.update(extra)
        index["weight_map"].update(dict.fromkeys(extra, last))
    save_file(tensors, str(folder / last), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return folder


def build_sdar(folder: Path, *, seed: int = 0) -> Path:
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**_common(), intermediate_size=128, rope_theta=1e6)
    _save(transformers.Qwen3MoeForCausalLM(config), folder)
    return folder


def build_llada2(folder: Path, *, seed: int = 0) -> Path:
    import transformers
    from safetensors.torch import save_file

    from worker.model.config import ModelConfig
    from worker.model.demo_tokenizer import IM_END, PAD
    from worker.model.hf_names import hf_targets

    common = _common()
    config = ModelConfig(
        **{k: v for k, v in common.items() if k != "max_position_embeddings"},
        max_position_embeddings=common["max_position_embeddings"], intermediate_size=128,
        model_type="llada2_moe", router_type="sigmoid_group", n_group=4, topk_group=2,
        routed_scaling_factor=2.5, shared_expert_intermediate_size=32, shared_expert_gated=False,
        mlp_only_layers=(0,), norm_topk_prob=True, partial_rotary_factor=0.5, rope_theta=1e6,
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    _save(_TokenizerOnly(), folder)  # the tokenizer files, as transformers writes them
    gen = torch.Generator().manual_seed(seed)
    shards: dict[str, dict[str, torch.Tensor]] = {"embed": {}, "head": {}, "layers": {}}
    for name, target in sorted(hf_targets(config).items()):
        if name.endswith("norm.weight"):
            t = torch.ones(target.shape)
        elif name.endswith("expert_bias"):
            t = torch.zeros(target.shape)
        else:
            t = torch.randn(target.shape, generator=gen) / math.sqrt(target.shape[-1])
        part = "embed" if "word_embeddings" in name else "head" if name == "lm_head.weight" else "layers"
        shards[part][name] = t.contiguous()
    shards["head"]["lm_head.weight"][512:] = 0.0  # rows past the tokenizer's ids never win
    weight_map = {}
    for i, (part, tensors) in enumerate(shards.items(), start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        del part
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}, indent=2))
    cfg = config.to_hf_dict()
    for key in ("block_size", "mask_token_id"):
        cfg.pop(key, None)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    cfg.update(eos_token_id=tok.convert_tokens_to_ids(IM_END), pad_token_id=tok.convert_tokens_to_ids(PAD))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg["eos_token_id"]}) + "\n")
    return folder


class _TokenizerOnly:
    """Stands in for a model in ``_save``: the LLaDA2 shards are written separately."""

    class _Head:
        weight = torch.zeros(1, 1)

    lm_head = _Head()

    def save_pretrained(self, folder: Path, **_: Any) -> None:
        return None


BUILDERS: dict[str, Callable[..., Path]] = {
    "clover": build_clover,
    "sdar": build_sdar,
    "llada2": build_llada2,
}
