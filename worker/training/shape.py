"""A wider or deeper trained demo than the ``tiny`` shape: the random start ``train-demo`` writes.

``worker.model.demo`` has two sizes (``tiny``: hidden 64, 4 layers; ``small``: hidden 512, for
benchmarks). The trained demo must read a contract, a retrieval the tiny width learns slowly on
CPU (docs/demo-training.md), so ``train-demo --hidden/--layers`` starts from the tiny demo with
these fields scaled: the head count stays (4 query heads, 2 KV heads, 2/4 GDN heads), head
dimensions and expert widths follow ``hidden``, and layers keep Clover's GDN/attention
alternation. The weights are drawn by the demo's own initialiser (``random_weights``), so a
shaped demo is as deterministic as the tiny one (same seed and shape: the same bytes).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer

from worker.model.checkpoint import SINGLE_NAME
from worker.model.config import ModelConfig
from worker.model.demo import DemoArch, random_weights, write_demo_checkpoint, write_json
from worker.model.demo_tokenizer import IM_START, MASK, PAD
from worker.model.manifest import write_manifest

TINY_HIDDEN, TINY_LAYERS = 64, 4


LAYER_CODES = {"L": "linear_attention", "A": "full_attention"}  # a Clover layer pattern's letters


def layer_types(pattern: str, layers: int) -> tuple[str, ...]:
    """Clover's layer types from ``pattern`` repeated over ``layers`` ("LA": GDN then attention, the
    demo's alternation; "A": attention only; "LAA": two attention layers per GDN layer)."""
    if not pattern or set(pattern) - set(LAYER_CODES) or layers % len(pattern):
        raise ValueError(f"a layer pattern is L/A letters dividing the layers, not {pattern!r} / {layers}")
    return tuple(LAYER_CODES[c] for c in pattern * (layers // len(pattern)))


def shaped_config(
    config: ModelConfig, hidden: int, layers: int, pattern: str = "LA", block_size: int | None = None
) -> ModelConfig:
    """``config`` (the tiny demo's) with ``hidden`` and ``layers``, the other widths scaled along;
    a Clover's layers follow ``pattern`` (``layer_types``); ``block_size`` when given."""
    if hidden % 16 or layers % len(pattern):
        raise ValueError(f"hidden must be a multiple of 16, layers of the pattern, not {hidden} / {layers}")
    head = hidden // config.num_attention_heads
    fields: dict[str, object] = {"hidden_size": hidden, "num_hidden_layers": layers, "head_dim": head}
    if block_size is not None:
        if block_size < 1:
            raise ValueError(f"a block size is a positive number of tokens, not {block_size}")
        fields["block_size"] = block_size
    if config.family == "clover":
        fields |= {"layer_types": layer_types(pattern, layers),
                   "linear_key_head_dim": head, "linear_value_head_dim": head}  # fmt: skip
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size"):
        width = getattr(config, name)
        if width:
            fields[name] = width * hidden // TINY_HIDDEN
    return dataclasses.replace(config, **fields)  # type: ignore[arg-type]


def write_shaped_demo(
    folder: Path,
    *,
    seed: int,
    arch: DemoArch,
    tokenizer: HFTokenizer,
    hidden: int,
    layers: int,
    pattern: str = "LA",
    block_size: int | None = None,
) -> None:
    """The random demo of ``seed`` in ``folder`` at ``hidden`` x ``layers`` (fp32 weights), a
    Clover's layers after ``pattern``, blocks of ``block_size`` (None: the demo's); the tiny demo
    itself for 64 x 4 "LA" and no block size."""
    write_demo_checkpoint(folder, seed=seed, size="tiny", arch=arch, tokenizer=tokenizer)
    if (hidden, layers, pattern, block_size) == (TINY_HIDDEN, TINY_LAYERS, "LA", None):
        return
    hf = json.loads((folder / "config.json").read_text())
    config = shaped_config(ModelConfig.from_hf_dict(hf), hidden, layers, pattern, block_size)
    write_json(folder / "config.json", config.to_hf_dict())
    if block_size is not None:  # the generation config names the block too
        _reblock_generation_config(folder, block_size)
    never = [tokenizer.token_to_id(t) for t in (MASK, PAD, IM_START)]
    weights = random_weights(config, seed=seed, dtype=torch.float32, never_generated=never)  # type: ignore[arg-type]
    mode = (folder / SINGLE_NAME).stat().st_mode & 0o777
    save_file(weights, str(folder / SINGLE_NAME), metadata={"format": "pt"})
    (folder / SINGLE_NAME).chmod(mode)
    write_manifest(folder)


def reblock(folder: Path, block_size: int) -> None:
    """Set the checkpoint in ``folder`` to blocks of ``block_size`` (the caller writes the manifest).
    No weight depends on the block size: the engine and the trainer lay out and denoise blocks of
    it (CLOVER.md: ``block_size`` when the config has one). ``config.json`` is what cloverq reads;
    ``generation_config.json`` is set alike where it names a block (``block_size``, or the
    ``block_length`` some diffusion checkpoints use), so no reader of it decodes other blocks."""
    _update_json(folder / "config.json", {"block_size": block_size})
    _reblock_generation_config(folder, block_size)


def _reblock_generation_config(folder: Path, block_size: int) -> None:
    path = folder / "generation_config.json"
    if path.is_file():
        named = [k for k in ("block_size", "block_length") if k in json.loads(path.read_text())]
        _update_json(path, dict.fromkeys(named, block_size))


def _update_json(path: Path, values: dict[str, int]) -> None:
    """``values`` written into the JSON object at ``path`` (nothing written when empty)."""
    if values:
        write_json(path, {**json.loads(path.read_text()), **values})
