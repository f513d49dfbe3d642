"""Load a Hugging Face-layout checkpoint folder (SDAR-MoE or Clover) into our model.

The model is built on the meta device, materialised once on the target device and dtype, and
filled tensor by tensor from memory-mapped safetensors shards, so at most one checkpoint tensor
is ever held besides the model. Checkpoint names (``model.layers.N.mlp.experts.E.gate_proj.weight``
...) are mapped to our stacked in-memory layout (``hf_names.py``), not in the model;
``mapped_tensors`` is the one checked walk over a checkpoint's tensors, shared with the
tensor-parallel rank loader (``parallel/shard.py``). Every missing,
unexpected or misshaped tensor is reported by name.

Clover checkpoints come in several spellings of the same tensors: prefix ``model.`` or
``model.language_model.``; experts per expert or fused (``mlp.experts.gate_up_proj`` /
``down_proj``); ``conv_right_weight`` as ``[C, K-1]`` or ``[C, 1, K-1]``. Vision (``model.visual.*``)
and multi-token-prediction (``mtp.*``) tensors are skipped, and said so once in the log.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

from worker.model import clover_decided, fp8
from worker.model.config import CLOVER_MODEL_TYPES, ConfigError, ModelConfig
from worker.model.family import DiffusionModel, build_model
from worker.model.hf_defaults import resolve_dtype
from worker.model.hf_names import (
    IGNORED_SUFFIXES,
    PREVIEW_TENSORS,
    SKIPPED_PREFIXES,
    HfTarget,
    canonical_name,
    copy_into,
    fused_experts_in,
    hf_targets,
    unmapped_params,
)
from worker.model.manifest import CheckReport, manifest_digest, verify_manifest
from worker.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(RuntimeError):
    """The checkpoint folder cannot be loaded (the message names the offending file or tensor)."""


@dataclass
class LoadedModel:
    """A model ready to run plus everything read alongside it."""

    model: DiffusionModel
    config: ModelConfig
    tokenizer: Tokenizer
    generation_config: dict[str, Any]
    path: Path
    manifest_digest: str
    verification: CheckReport | None = None  # the manifest check done at load (None: skipped)



def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path.name} is missing from {path.parent}") from exc
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def read_config(folder: Path, *, allow_causal_trunk: bool = False) -> ModelConfig:
    """``config.json`` of ``folder`` with the mask/eos ids completed from the tokenizer files."""
    folder = Path(folder)
    try:
        config = ModelConfig.from_hf_dict(
            read_json(folder / "config.json"), allow_causal_trunk=allow_causal_trunk
        )
    except ConfigError as exc:
        raise CheckpointError(f"{folder / 'config.json'}: {exc}") from exc
    gen = _generation_config(folder)
    updates: dict[str, Any] = {}
    gen_eos = gen.get("eos_token_id")
    if gen_eos is not None:
        gen_ids = tuple(gen_eos) if isinstance(gen_eos, list) else (int(gen_eos),)
        updates["eos_token_ids"] = tuple(dict.fromkeys((*gen_ids, *config.eos_token_ids)))
    if config.block_size is None and gen.get("block_size") is not None:
        updates["block_size"] = int(gen["block_size"])
    if config.mask_token_id is None and gen.get("mask_token_id") is not None:
        updates["mask_token_id"] = int(gen["mask_token_id"])
    clover = config.family == "clover"
    if (
        config.mask_token_id is None
        and "mask_token_id" not in updates
        and (folder / "tokenizer.json").is_file()
    ):
        candidates = clover_decided.MASK_TOKEN_CANDIDATES if clover else None
        updates["mask_token_id"] = Tokenizer.find_mask_token_id(folder / "tokenizer.json", candidates)
    if clover and config.block_size is None and "block_size" not in updates:
        updates["block_size"] = clover_decided.DEFAULT_BLOCK_SIZE
    config = dataclasses.replace(config, **updates) if updates else config
    if clover and config.mask_token_id is None and not allow_causal_trunk:
        raise CheckpointError(
            f"{folder}: no mask token: config.json has no mask_token_id and the tokenizer has none of "
            f"{', '.join(clover_decided.MASK_TOKEN_CANDIDATES)}"
        )
    return config


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
) -> DiffusionModel:
    """The model with uninitialised storage on ``device`` in ``dtype`` (one allocation, no init).

    Materialised with ``torch.empty(shape)`` rather than ``Module.to_empty`` for the same
    reason as ``_SkipParameterInit``: ``empty_like`` of a meta tensor goes through torch's
    Python reference kernels (a slow first import). Tensors built here are contiguous, so a
    plain ``empty`` of the same shape is equivalent.
    """
    with torch.device("meta"), _SkipParameterInit():
        model = build_model(config)
    model = model.to(dtype)
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))  # same shapes
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval()


def tensor_names(files: list[Path]) -> dict[str, Path]:
    """Every tensor name in ``files`` -> the file holding it (headers only, no data read)."""
    names: dict[str, Path] = {}
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"weight file {file.name} is missing from {file.parent}")
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                names[name] = file
    return names




@dataclass(frozen=True)
class MappedTensor:
    """One checkpoint tensor with a place in the model, its shape already checked."""

    handle: Any  # the open safetensors file (``safe_open``) holding it
    file: Path
    name: str  # as the checkpoint spells it
    target: HfTarget


@dataclass
class CheckpointWalk:
    """The tensors of ``files`` mapped onto ``model``'s parameters, checked as both loaders need.

    Built, it has refused a model with parameters no checkpoint tensor fills (and zeroed the
    preview tensors when ``with_preview`` is off). Iterated, it yields every tensor that fills a
    parameter, one open file at a time, skipping vision/MTP tensors and FP8 block scales (read
    with their tensor); a tensor of the wrong shape raises at once, and once all are read the
    missing and unexpected ones are reported by name (``CheckpointError``).
    """

    params: dict[str, torch.Tensor]
    found: dict[str, Path]  # tensor name -> file
    targets: dict[str, HfTarget]
    tie_word_embeddings: bool

    def __iter__(self) -> Iterator[MappedTensor]:
        seen: set[str] = set()
        unexpected: list[str] = []
        by_file: dict[Path, list[str]] = {}
        for name, file in self.found.items():
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in names:
                    if name.startswith(SKIPPED_PREFIXES):
                        continue
                    if fp8.is_scale(name) and name.removesuffix(fp8.SCALE_SUFFIX) in self.found:
                        continue  # an FP8 tensor's block scales, read with it
                    key = canonical_name(name)
                    target = self.targets.get(key)
                    if target is None:
                        if key == "lm_head.weight" and self.tie_word_embeddings:
                            continue  # a tied checkpoint may still store the shared matrix
                        if not name.endswith(IGNORED_SUFFIXES):
                            unexpected.append(name)
                        continue
                    shape = tuple(f.get_slice(name).get_shape())
                    if not target.accepts(shape):
                        raise CheckpointError(
                            f"tensor {name} in {file.name} has shape {list(shape)}, "
                            f"expected {list(target.shape)}"
                        )
                    seen.add(key)
                    yield MappedTensor(f, file, name, target)
        missing = sorted(set(self.targets) - seen)
        if unexpected or missing:
            parts = []
            if missing:
                parts.append(
                    f"missing tensors: {', '.join(missing[:20])}" + (" ..." if len(missing) > 20 else "")
                )
            if unexpected:
                parts.append(f"unexpected tensors: {', '.join(sorted(unexpected)[:20])}")
            raise CheckpointError("; ".join(parts))


def mapped_tensors(
    model: DiffusionModel, files: list[Path], config: ModelConfig, *, with_preview: bool = True
) -> CheckpointWalk:
    """The checked walk of ``files`` onto ``model`` (``config``: the checkpoint's, whose names
    the files hold; a tensor-parallel rank's model is built from a narrower one).

    ``with_preview=False`` maps a causal trunk without Clover's block-diffusion tensors (their
    parameters are zeroed: fit for checking the causal path only).
    """
    found = tensor_names(files)
    targets = hf_targets(config, fused_experts=fused_experts_in(found), with_preview=with_preview)
    params = dict(model.named_parameters(remove_duplicate=False))
    unmapped = unmapped_params(params, targets, config, with_preview=with_preview)
    if unmapped:  # a model parameter no checkpoint tensor fills would stay uninitialised
        raise CheckpointError(f"no checkpoint name maps to parameters: {', '.join(sorted(unmapped))}")
    if not with_preview:
        with torch.no_grad():
            for name in params:
                if name.rsplit(".", 1)[-1] in PREVIEW_TENSORS:
                    params[name].zero_()
    return CheckpointWalk(params, found, targets, config.tie_word_embeddings)


def load_weights(model: DiffusionModel, files: list[Path], *, with_preview: bool = True) -> None:
    """Fill ``model`` from ``files``; raise ``CheckpointError`` naming bad/missing/unexpected tensors.

    ``with_preview=False`` loads a causal trunk without Clover's block-diffusion tensors (their
    parameters stay zero: fit for checking the causal path only).
    """
    config = model.config
    walk = mapped_tensors(model, files, config, with_preview=with_preview)
    skipped = sorted(n for n in walk.found if n.startswith(SKIPPED_PREFIXES))
    if skipped:
        log.info(
            "ignoring %d vision/MTP tensors (e.g. %s): cloverq serves the text trunk",
            len(skipped),
            skipped[0],
        )
    for item in walk:
        with torch.no_grad():
            tensor = item.handle.get_tensor(item.name)
            if tensor.dtype in fp8.FP8_DTYPES:  # block-scaled FP8 (fp8.py): dequantized here
                tensor = _dequantize_fp8(item.handle, item.name, tensor, walk.found, config)
            copy_into(walk.params, item.target, tensor)


def _dequantize_fp8(
    f: Any, name: str, tensor: torch.Tensor, found: dict[str, Path], config: ModelConfig
) -> torch.Tensor:
    scale = fp8.read_scale(f, name, found)
    if scale is None:
        raise CheckpointError(f"float8 tensor {name} has no {fp8.scale_name(name)} (block scales)")
    try:
        return fp8.dequantize(tensor, scale, fp8.block_size(config.extra))
    except ValueError as exc:
        raise CheckpointError(f"tensor {name}: {exc}") from exc


def load_checkpoint(
    path: Path | str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = torch.float32,
    verify: bool | Literal["full", "quick"] = True,
    allow_causal_trunk: bool = False,
) -> LoadedModel:
    """Verify (unless told not to) and load a checkpoint folder onto ``device`` in ``dtype``.

    ``verify``: ``True``/``"full"`` hashes every byte against ``manifest.json``, ``"quick"`` checks
    sizes and sampled chunks (``worker.model.manifest``), ``False`` skips the check. ``dtype=None``:
    the checkpoint's own (``config.json`` ``dtype``/``torch_dtype``, else float32).

    ``allow_causal_trunk`` also loads a plain ``qwen3_5_moe`` trunk (no preview tensors) to check
    the causal path against transformers; such a model is never served.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    report = verify_manifest(folder, mode="full" if verify is True else verify) if verify else None
    config = read_config(folder, allow_causal_trunk=allow_causal_trunk)
    if dtype is None:
        try:
            dtype = resolve_dtype(config)
        except ConfigError as exc:
            raise CheckpointError(f"{folder / 'config.json'}: {exc}") from exc
    tokenizer = Tokenizer.from_dir(folder)
    model = build_empty_model(config, device=device, dtype=dtype)
    trunk_only = config.family == "clover" and config.model_type not in CLOVER_MODEL_TYPES
    load_weights(model, weight_files(folder), with_preview=not trunk_only)
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        generation_config=_generation_config(folder),
        path=folder,
        manifest_digest=manifest_digest(folder),
        verification=report,
    )
