"""Load a Hugging Face-layout Qwen3-MoE / SDAR-MoE checkpoint folder into our model.

The model is built on the meta device, materialised once on the target device and dtype, and
filled tensor by tensor from memory-mapped safetensors shards, so at most one checkpoint tensor
is ever held besides the model. Checkpoint names (``model.layers.N.mlp.experts.E.gate_proj.weight``
...) are mapped to our stacked in-memory layout here, not in the model. Every missing,
unexpected or misshaped tensor is reported by name.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

from worker.model.config import ModelConfig
from worker.model.manifest import manifest_digest, verify_manifest
from worker.model.model import CloverForBlockDiffusion
from worker.model.tokenizer import Tokenizer

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(RuntimeError):
    """The checkpoint folder cannot be loaded (the message names the offending file or tensor)."""


@dataclass
class LoadedModel:
    """A model ready to run plus everything read alongside it."""

    model: CloverForBlockDiffusion
    config: ModelConfig
    tokenizer: Tokenizer
    generation_config: dict[str, Any]
    path: Path
    manifest_digest: str


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes in our model."""

    param: str  # our parameter name
    shape: tuple[int, ...]  # its shape in the checkpoint
    expert: int | None = None  # stacked expert index
    part: Literal["gate", "up", "down"] | None = None


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path.name} is missing from {path.parent}") from exc
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def read_config(folder: Path) -> ModelConfig:
    """``config.json`` of ``folder`` with the mask/eos ids completed from the tokenizer files."""
    folder = Path(folder)
    config = ModelConfig.from_hf_dict(read_json(folder / "config.json"))
    gen = _generation_config(folder)
    updates: dict[str, Any] = {}
    gen_eos = gen.get("eos_token_id")
    if gen_eos is not None:
        gen_ids = tuple(gen_eos) if isinstance(gen_eos, list) else (int(gen_eos),)
        updates["eos_token_ids"] = tuple(dict.fromkeys((*gen_ids, *config.eos_token_ids)))
    if config.block_size is None and gen.get("block_size") is not None:
        updates["block_size"] = int(gen["block_size"])
    if config.mask_token_id is None and (folder / "tokenizer.json").is_file():
        updates["mask_token_id"] = Tokenizer.find_mask_token_id(folder / "tokenizer.json")
    return dataclasses.replace(config, **updates) if updates else config


def _generation_config(folder: Path) -> dict[str, Any]:
    path = folder / "generation_config.json"
    return read_json(path) if path.is_file() else {}


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or the single file."""
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map: dict[str, str] = read_json(index).get("weight_map", {})
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / SINGLE_NAME).is_file():
        return [folder / SINGLE_NAME]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"no *.safetensors in {folder}")
    return found


def hf_targets(config: ModelConfig) -> dict[str, _Target]:
    """Checkpoint tensor name -> where it lives in ``CloverForBlockDiffusion``."""
    h, d = config.hidden_size, config.head_dim
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    t: dict[str, _Target] = {
        "model.embed_tokens.weight": _Target("embed.weight", (config.vocab_size, h)),
        "model.norm.weight": _Target("norm.weight", (h,)),
    }
    if not config.tie_word_embeddings:
        t["lm_head.weight"] = _Target("lm_head.weight", (config.vocab_size, h))
    for n in range(config.num_hidden_layers):
        src, dst = f"model.layers.{n}", f"layers.{n}"
        t[f"{src}.input_layernorm.weight"] = _Target(f"{dst}.input_norm.weight", (h,))
        t[f"{src}.post_attention_layernorm.weight"] = _Target(f"{dst}.post_attn_norm.weight", (h,))
        for name, out in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
            t[f"{src}.self_attn.{name}_proj.weight"] = _Target(f"{dst}.attn.{name}_proj.weight", (out, h))
            if config.attention_bias:
                t[f"{src}.self_attn.{name}_proj.bias"] = _Target(f"{dst}.attn.{name}_proj.bias", (out,))
        t[f"{src}.self_attn.o_proj.weight"] = _Target(f"{dst}.attn.o_proj.weight", (h, heads * d))
        if config.attention_bias:
            t[f"{src}.self_attn.o_proj.bias"] = _Target(f"{dst}.attn.o_proj.bias", (h,))
        t[f"{src}.self_attn.q_norm.weight"] = _Target(f"{dst}.attn.q_norm.weight", (d,))
        t[f"{src}.self_attn.k_norm.weight"] = _Target(f"{dst}.attn.k_norm.weight", (d,))
        if config.is_moe_layer(n):
            i = config.moe_intermediate_size
            t[f"{src}.mlp.gate.weight"] = _Target(f"{dst}.mlp.router.weight", (config.num_experts, h))
            for e in range(config.num_experts):
                ex = f"{src}.mlp.experts.{e}"
                t[f"{ex}.gate_proj.weight"] = _Target(f"{dst}.mlp.w_gate_up", (i, h), e, "gate")
                t[f"{ex}.up_proj.weight"] = _Target(f"{dst}.mlp.w_gate_up", (i, h), e, "up")
                t[f"{ex}.down_proj.weight"] = _Target(f"{dst}.mlp.w_down", (h, i), e, "down")
        else:
            i = config.intermediate_size
            for name, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
                t[f"{src}.mlp.{name}_proj.weight"] = _Target(f"{dst}.mlp.{name}_proj.weight", shape)
    return t


def _copy_into(param: torch.Tensor, target: _Target, tensor: torch.Tensor) -> None:
    if target.part is None:
        param.copy_(tensor)
        return
    half = param.shape[-1] // 2
    if target.part == "gate":
        param[target.expert, :, :half].copy_(tensor.T)  # [H, I] <- [I, H]^T
    elif target.part == "up":
        param[target.expert, :, half:].copy_(tensor.T)
    else:
        param[target.expert].copy_(tensor.T)  # [I, H] <- [H, I]^T


class _SkipParameterInit(TorchFunctionMode):
    """Turns ``torch.nn.init.*`` calls into no-ops while a model is built on the meta device.

    The weights are overwritten by the checkpoint anyway, and on meta tensors some of these
    initialisers (``normal_``) run torch's Python reference kernels, whose first call imports
    torch._dynamo and sympy: 3-6 s of every worker start-up for nothing.
    """

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs.get("tensor") if kwargs else None
        return func(*args, **(kwargs or {}))


def build_empty_model(
    config: ModelConfig, *, device: torch.device | str, dtype: torch.dtype
) -> CloverForBlockDiffusion:
    """The model with uninitialised storage on ``device`` in ``dtype`` (one allocation, no init).

    Materialised with ``torch.empty(shape)`` rather than ``Module.to_empty`` for the same
    reason as ``_SkipParameterInit``: ``empty_like`` of a meta tensor goes through torch's
    Python reference kernels (a slow first import). Tensors built here are contiguous, so a
    plain ``empty`` of the same shape is equivalent.
    """
    with torch.device("meta"), _SkipParameterInit():
        model = CloverForBlockDiffusion(config)
    model = model.to(dtype)
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))  # same shapes
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval()


def load_weights(model: CloverForBlockDiffusion, files: list[Path]) -> None:
    """Fill ``model`` from ``files``; raise ``CheckpointError`` naming bad/missing/unexpected tensors."""
    config = model.config
    targets = hf_targets(config)
    params = dict(model.named_parameters(remove_duplicate=False))
    unmapped = (
        set(params)
        - {t.param for t in targets.values()}
        - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    )
    if unmapped:  # a model parameter no checkpoint tensor fills would stay uninitialised
        raise CheckpointError(f"no checkpoint name maps to parameters: {', '.join(sorted(unmapped))}")
    seen: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"weight file {file.name} is missing from {file.parent}")
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                target = targets.get(name)
                if target is None:
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # a tied checkpoint may still store the shared matrix
                    if not name.endswith(_IGNORED_SUFFIXES):
                        unexpected.append(name)
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != target.shape:
                    raise CheckpointError(
                        f"tensor {name} in {file.name} has shape {list(shape)}, expected {list(target.shape)}"
                    )
                with torch.no_grad():
                    _copy_into(params[target.param], target, f.get_tensor(name))
                seen.add(name)
    missing = sorted(set(targets) - seen)
    if unexpected or missing:
        parts = []
        if missing:
            parts.append(
                f"missing tensors: {', '.join(missing[:20])}" + (" ..." if len(missing) > 20 else "")
            )
        if unexpected:
            parts.append(f"unexpected tensors: {', '.join(sorted(unexpected)[:20])}")
        raise CheckpointError("; ".join(parts))


def load_checkpoint(
    path: Path | str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    verify: bool = True,
) -> LoadedModel:
    """Verify (unless told not to) and load a checkpoint folder onto ``device`` in ``dtype``."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    if verify:
        verify_manifest(folder)
    config = read_config(folder)
    tokenizer = Tokenizer.from_dir(folder)
    model = build_empty_model(config, device=device, dtype=dtype)
    load_weights(model, weight_files(folder))
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        generation_config=_generation_config(folder),
        path=folder,
        manifest_digest=manifest_digest(folder),
    )
