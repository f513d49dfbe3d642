"""Load a Hugging Face-layout checkpoint folder (SDAR-MoE or Clover) into our model.

The model is built on the meta device, materialised once on the target device and dtype, and
filled tensor by tensor from memory-mapped safetensors shards, so at most one checkpoint tensor
is ever held besides the model. Checkpoint names (``model.layers.N.mlp.experts.E.gate_proj.weight``
...) are mapped to our stacked in-memory layout here, not in the model. Every missing,
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
from worker.model.manifest import CheckReport, manifest_digest, verify_manifest
from worker.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_SKIPPED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")  # vision tower, MTP head: not served
_NESTED_PREFIX = "model.language_model."  # multimodal checkpoints nest the trunk here
# our GDN parameter -> the block-diffusion tensor's checkpoint name (under ...linear_attn.)
PREVIEW_TENSORS: dict[str, str] = {
    "conv_right_weight": "conv_right_weight",
    "bd_logit_scale": "bd_softmax_logit_scale",
    "bd_history_bias": "bd_softmax_history_bias",
    "bd_history_c": "bd_softmax_history_c",
}


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


@dataclass(frozen=True)
class _Target:
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


def canonical_name(name: str) -> str:
    """One spelling for the trunk's tensor names (``model.language_model.X`` -> ``model.X``)."""
    return "model." + name[len(_NESTED_PREFIX) :] if name.startswith(_NESTED_PREFIX) else name


def hf_targets(
    config: ModelConfig, *, fused_experts: bool = False, with_preview: bool = True
) -> dict[str, _Target]:
    """Checkpoint tensor name (canonical spelling) -> where it lives in our model.

    ``fused_experts``: the checkpoint stores each layer's experts as two stacked tensors;
    ``with_preview``: Clover's block-diffusion tensors are required (not for a causal trunk).
    """
    if config.family == "clover":
        return _clover_targets(config, fused_experts=fused_experts, with_preview=with_preview)
    if config.family == "llada2":
        return _llada2_targets(config)
    return _sdar_targets(config)


def _shared_targets(config: ModelConfig) -> dict[str, _Target]:
    """Embedding, final norm, LM head and every layer's two norms: the same names in both families."""
    h = config.hidden_size
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
    return t


def _sdar_targets(config: ModelConfig) -> dict[str, _Target]:
    """Qwen3-MoE / SDAR-MoE names -> ``BlockCausalForBlockDiffusion``."""
    h, d = config.hidden_size, config.head_dim
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    t = _shared_targets(config)
    for n in range(config.num_hidden_layers):
        src, dst = f"model.layers.{n}", f"layers.{n}"
        for name, out in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
            t[f"{src}.self_attn.{name}_proj.weight"] = _Target(f"{dst}.attn.{name}_proj.weight", (out, h))
            if config.attention_bias:
                t[f"{src}.self_attn.{name}_proj.bias"] = _Target(f"{dst}.attn.{name}_proj.bias", (out,))
        t[f"{src}.self_attn.o_proj.weight"] = _Target(f"{dst}.attn.o_proj.weight", (h, heads * d))
        if config.attention_bias:
            t[f"{src}.self_attn.o_proj.bias"] = _Target(f"{dst}.attn.o_proj.bias", (h,))
        t[f"{src}.self_attn.q_norm.weight"] = _Target(f"{dst}.attn.q_norm.weight", (d,))
        t[f"{src}.self_attn.k_norm.weight"] = _Target(f"{dst}.attn.k_norm.weight", (d,))
        t.update(_moe_targets(config, n, fused=False))
    return t


def _llada2_targets(config: ModelConfig) -> dict[str, _Target]:
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
            t[f"{src}.query_key_value.{kind}"] = _Target(split[0][0], shape, split=split)
        t[f"{src}.dense.weight"] = _Target(f"{dst}.o_proj.weight", (h, heads * d))
        if config.attention_bias:
            t[f"{src}.dense.bias"] = _Target(f"{dst}.o_proj.bias", (h,))
        t[f"{src}.query_layernorm.weight"] = _Target(f"{dst}.q_norm.weight", (d,))
        t[f"{src}.key_layernorm.weight"] = _Target(f"{dst}.k_norm.weight", (d,))
        moe = _moe_targets(config, n, fused=False)
        if config.is_moe_layer(n):  # BailingMoeV2 spells the shared expert(s) and the bias its way
            mlp, ours = f"model.layers.{n}.mlp", f"layers.{n}.mlp"
            for part in ("gate", "up", "down"):
                moe[f"{mlp}.shared_experts.{part}_proj.weight"] = moe.pop(
                    f"{mlp}.shared_expert.{part}_proj.weight"
                )
            moe[f"{mlp}.gate.expert_bias"] = _Target(f"{ours}.expert_bias", (config.num_experts,))
        t.update(moe)
    return t


def _clover_targets(config: ModelConfig, *, fused_experts: bool, with_preview: bool) -> dict[str, _Target]:
    """Qwen3.5-MoE / Clover names -> ``CloverHybridForBlockDiffusion``."""
    h, d = config.hidden_size, config.head_dim
    heads, kv = config.num_attention_heads, config.num_key_value_heads
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
                t[f"{la}.{name}"] = _Target(f"{mx}.{name}", shape)
            t[f"{la}.conv1d.weight"] = _Target(f"{mx}.conv_weight", (c, 1, k), also=((c, k),))
            if with_preview:
                for ours, theirs in PREVIEW_TENSORS.items():
                    shape, also = (
                        ((c, k - 1), ((c, 1, k - 1),)) if ours == "conv_right_weight" else ((hv,), ())
                    )
                    t[f"{la}.{theirs}"] = _Target(f"{mx}.{ours}", shape, also=also)
        else:
            sa, mx = f"{src}.self_attn", f"{dst}.mixer"
            for name, out in (("q", 2 * heads * d), ("k", kv * d), ("v", kv * d)):
                t[f"{sa}.{name}_proj.weight"] = _Target(f"{mx}.{name}_proj.weight", (out, h))
                if config.attention_bias:
                    t[f"{sa}.{name}_proj.bias"] = _Target(f"{mx}.{name}_proj.bias", (out,))
            t[f"{sa}.o_proj.weight"] = _Target(f"{mx}.o_proj.weight", (h, heads * d))
            if config.attention_bias:
                t[f"{sa}.o_proj.bias"] = _Target(f"{mx}.o_proj.bias", (h,))
            t[f"{sa}.q_norm.weight"] = _Target(f"{mx}.q_norm.weight", (d,))
            t[f"{sa}.k_norm.weight"] = _Target(f"{mx}.k_norm.weight", (d,))
        t.update(_moe_targets(config, n, fused_experts))
    return t


def _moe_targets(config: ModelConfig, n: int, fused: bool) -> dict[str, _Target]:
    """Layer ``n``'s feed-forward: router, experts (per expert or fused) and shared expert, or the
    dense MLP of a layer without experts (the same names in both families)."""
    h, e = config.hidden_size, config.num_experts
    src, dst = f"model.layers.{n}.mlp", f"layers.{n}.mlp"
    t: dict[str, _Target] = {}
    if not config.is_moe_layer(n):
        i = config.intermediate_size
        for name, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            t[f"{src}.{name}_proj.weight"] = _Target(f"{dst}.{name}_proj.weight", shape)
        return t
    i = config.moe_intermediate_size
    t[f"{src}.gate.weight"] = _Target(f"{dst}.router.weight", (e, h))
    if fused:
        t[f"{src}.experts.gate_up_proj"] = _Target(f"{dst}.w_gate_up", (e, 2 * i, h), part="gate_up_all")
        t[f"{src}.experts.down_proj"] = _Target(f"{dst}.w_down", (e, h, i), part="down_all")
    else:
        for x in range(e):
            ex = f"{src}.experts.{x}"
            t[f"{ex}.gate_proj.weight"] = _Target(f"{dst}.w_gate_up", (i, h), x, "gate")
            t[f"{ex}.up_proj.weight"] = _Target(f"{dst}.w_gate_up", (i, h), x, "up")
            t[f"{ex}.down_proj.weight"] = _Target(f"{dst}.w_down", (h, i), x, "down")
    s = config.shared_expert_intermediate_size
    if s:
        for name, shape in (("gate", (s, h)), ("up", (s, h)), ("down", (h, s))):
            t[f"{src}.shared_expert.{name}_proj.weight"] = _Target(
                f"{dst}.shared_expert.{name}_proj.weight", shape
            )
        if config.shared_expert_gated:
            t[f"{src}.shared_expert_gate.weight"] = _Target(f"{dst}.shared_expert_gate.weight", (1, h))
    return t


def _copy_into(param: torch.Tensor, target: _Target, tensor: torch.Tensor) -> None:
    if target.part is None:
        param.copy_(tensor.reshape(param.shape))  # e.g. conv1d.weight [C, 1, K] -> [C, K]
        return
    if target.part in ("gate_up_all", "down_all"):  # fused [E, out, in] -> our [E, in, out]
        param.copy_(tensor.transpose(1, 2))
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


def load_weights(model: DiffusionModel, files: list[Path], *, with_preview: bool = True) -> None:
    """Fill ``model`` from ``files``; raise ``CheckpointError`` naming bad/missing/unexpected tensors.

    ``with_preview=False`` loads a causal trunk without Clover's block-diffusion tensors (their
    parameters stay zero: fit for checking the causal path only).
    """
    config = model.config
    found = tensor_names(files)
    skipped = sorted(n for n in found if n.startswith(_SKIPPED_PREFIXES))
    if skipped:
        log.info(
            "ignoring %d vision/MTP tensors (e.g. %s): cloverq serves the text trunk",
            len(skipped),
            skipped[0],
        )
    fused = any(canonical_name(n).endswith("mlp.experts.gate_up_proj") for n in found)
    targets = hf_targets(config, fused_experts=fused, with_preview=with_preview)
    params = dict(model.named_parameters(remove_duplicate=False))
    preview_params = {n for n in params if n.rsplit(".", 1)[-1] in PREVIEW_TENSORS}
    unmapped = (
        set(params)
        - {p for t in targets.values() for p in t.params()}
        - ({"lm_head.weight"} if config.tie_word_embeddings else set())
        - (set() if with_preview else preview_params)
    )
    if unmapped:  # a model parameter no checkpoint tensor fills would stay uninitialised
        raise CheckpointError(f"no checkpoint name maps to parameters: {', '.join(sorted(unmapped))}")
    if not with_preview:
        with torch.no_grad():
            for name in preview_params:
                params[name].zero_()
    seen: set[str] = set()
    unexpected: list[str] = []
    by_file: dict[Path, list[str]] = {}
    for name, file in found.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in names:
                if name.startswith(_SKIPPED_PREFIXES):
                    continue
                if fp8.is_scale(name) and name.removesuffix(fp8.SCALE_SUFFIX) in found:
                    continue  # an FP8 tensor's block scales, read with it
                key = canonical_name(name)
                target = targets.get(key)
                if target is None:
                    if key == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # a tied checkpoint may still store the shared matrix
                    if not name.endswith(_IGNORED_SUFFIXES):
                        unexpected.append(name)
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if not target.accepts(shape):
                    raise CheckpointError(
                        f"tensor {name} in {file.name} has shape {list(shape)}, expected {list(target.shape)}"
                    )
                with torch.no_grad():
                    tensor = f.get_tensor(name)
                    if tensor.dtype in fp8.FP8_DTYPES:  # block-scaled FP8 (fp8.py): dequantized here
                        tensor = _dequantize_fp8(f, name, tensor, found, config)
                    if target.split:  # e.g. LLaDA2's query_key_value -> our q/k/v projections
                        for param, lo, hi in target.split:
                            params[param].copy_(tensor[lo:hi])
                    else:
                        _copy_into(params[target.param], target, tensor)
                seen.add(key)
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
