"""Check our causal trunk against the modeling code a checkpoint folder ships (``auto_map``).

A Hugging Face folder with custom code (``config.json`` ``auto_map``: ``AutoConfig`` and
``AutoModelForCausalLM`` naming ``module.Class`` in the folder) carries the official definition of
the model. Without loading its weights (70 GB for Clover-35B-A3B) we build a *tiny* random model
from that folder's own config and modeling classes: the same code and architecture flags (layer
pattern, head dims, partial RoPE, tied head, shared expert ...) at small widths, depths, head and
expert counts and vocabulary. Its state dict is saved as safetensors beside a ``config.json`` that
``ModelConfig.from_hf_dict`` reads (the reference config is expected to use Qwen3.5-MoE's field
names), loaded into our model with ``load_weights``, and both run the same random token ids:

- ``causal``: the reference's forward against our plain causal forward (no cache);
- ``commits``: the same against our prefill followed by block-by-block commits through a cache.

The largest absolute logit difference of the two, in float32, decides PASS against a tolerance.
The folder's code is imported locally (a throw-away package whose path is the folder, so its
relative imports work); nothing is fetched, and code from another repository (``repo--module``)
is refused. ``transformers`` is a test extra and imported here only.

A model of random weights has router near-ties only rarely; should one tip an expert choice, the
difference is large for one token: rerun with another seed.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import itertools
import json
import math
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import save_file

from worker.model.checkpoint import CheckpointError, build_empty_model, load_weights
from worker.model.config import FULL_ATTENTION, LINEAR_ATTENTION, ConfigError, ModelConfig
from worker.model.hf_names import PREVIEW_TENSORS

DEFAULT_TOLERANCE = 1e-4
CAUSAL_LM_KEY = "AutoModelForCausalLM"
CONFIG_KEY = "AutoConfig"
# tiny widths and counts; head dims are kept (they fix the RoPE split and the delta-rule state)
TINY_HIDDEN = 64
TINY_VOCAB = 256
TINY_HEADS = 4
TINY_LINEAR_KEY_HEADS = 2
TINY_EXPERTS = 8
TINY_TOP_K = 2
TINY_EXPERT_WIDTH = 32
TINY_DENSE_WIDTH = 64
MAX_TINY_LAYERS = 8
BATCH = 2
# prefill, then commits of whole blocks, then a partial block (> one 64-row delta-rule chunk)
COMMIT_BOUNDARIES = (0, 35, 40, 48, 56, 64, 72, 75)


class ReferenceCheckError(RuntimeError):
    """The check could not run (no remote code, transformers missing, the code does not build)."""


class NoRemoteCodeError(ReferenceCheckError):
    """config.json has no ``auto_map``: the folder ships no modeling code to compare with."""


class ReferenceMismatchError(RuntimeError):
    """The reference model's tensors do not fit ours, or its outputs have another shape."""


@dataclass(frozen=True)
class ReferenceCheckResult:
    """What was compared and the largest logit differences (float32)."""

    folder: Path
    model_class: str  # auto_map reference, e.g. "modeling_clover_moe.CloverMoeModelLM"
    config_class: str
    config: ModelConfig  # the tiny model's, as we read it
    with_preview: bool  # the reference carries Clover's block-diffusion tensors
    tokens: tuple[int, int]  # [batch, positions] of the random ids
    causal_diff: float  # reference vs our plain causal forward
    commit_diff: float  # reference vs our prefill + block commits through a cache
    tolerance: float

    @property
    def max_diff(self) -> float:
        diffs = (self.causal_diff, self.commit_diff)
        return float("nan") if any(math.isnan(d) for d in diffs) else max(diffs)  # a NaN is kept

    @property
    def passed(self) -> bool:
        return self.max_diff <= self.tolerance  # NaN compares False: a NaN fails

    def lines(self) -> list[str]:
        c = self.config
        kinds = [c.layer_types.count(LINEAR_ATTENTION), c.layer_types.count(FULL_ATTENTION)]
        verdict = "PASS" if self.passed else "FAIL"
        return [
            f"reference  {self.model_class} (config {self.config_class}) from {self.folder}",
            f"tiny model {c.num_hidden_layers} layers ({kinds[0]} linear, {kinds[1]} full attention), "
            f"hidden {c.hidden_size}, {c.num_experts} experts top-{c.num_experts_per_tok}, "
            f"vocab {c.vocab_size}, block-diffusion tensors {'yes' if self.with_preview else 'no'}",
            f"causal     max |logit difference| {self.causal_diff:.3e} "
            f"over {self.tokens[0]}x{self.tokens[1]} tokens",
            f"commits    max |logit difference| {self.commit_diff:.3e} (prefill, then block by block)",
            f"{verdict:<10} max |logit difference| {self.max_diff:.3e} "
            f"(tolerance {self.tolerance:.0e}, float32)",
        ]


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def remote_code_refs(config: dict[str, Any], folder: Path) -> tuple[str, str | None]:
    """``(model class ref, config class ref or None)`` from ``auto_map``; refuse what cannot load."""
    auto_map = config.get("auto_map")
    if not isinstance(auto_map, dict) or not auto_map:
        raise NoRemoteCodeError(
            f"{folder / 'config.json'} has no auto_map: the folder ships no modeling code to check against"
        )
    model_ref = auto_map.get(CAUSAL_LM_KEY)
    if not isinstance(model_ref, str):
        raise ReferenceCheckError(
            f"{folder / 'config.json'}: auto_map has no {CAUSAL_LM_KEY} "
            f"(it names {', '.join(sorted(auto_map))})"
        )
    config_ref = auto_map.get(CONFIG_KEY)
    for ref in (model_ref, config_ref):
        if isinstance(ref, str) and "--" in ref:
            raise ReferenceCheckError(
                f"auto_map entry {ref!r} points at code in another repository: only the folder's own "
                "files are loaded (no network)"
            )
    return model_ref, config_ref if isinstance(config_ref, str) else None


@contextmanager
def _folder_package(folder: Path) -> Iterator[str]:
    """A throw-away package whose path is ``folder`` (relative imports inside it resolve)."""
    name = f"_cloverq_reference_{uuid.uuid4().hex[:12]}"
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(folder)]
    sys.modules[name] = package
    try:
        yield name
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings (kernel fallbacks on CPU ...) off while the check runs."""
    from transformers.utils import logging as hf_logging  # deferred: transformers, a heavy test extra

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _import_class(folder: Path, package: str, ref: str) -> type:
    module_name, _, class_name = ref.rpartition(".")
    if not module_name or not class_name:
        raise ReferenceCheckError(f"auto_map entry {ref!r} is not 'module.Class'")
    file = folder / (module_name.replace(".", "/") + ".py")
    if not file.is_file():
        raise ReferenceCheckError(f"auto_map names {ref!r} but {file.name} is not in {folder}")
    try:
        module: ModuleType = importlib.import_module(f"{package}.{module_name}")
    except Exception as exc:  # the folder's code: any failure is reported, in one line
        raise ReferenceCheckError(
            f"cannot import {file.name} from {folder}: {type(exc).__name__}: {_one_line(exc)}"
        ) from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ReferenceCheckError(f"{file.name} in {folder} defines no class {class_name}")
    return cls


def _layer_types(d: dict[str, Any]) -> list[str]:
    types = d.get("layer_types")
    if isinstance(types, list) and types:
        return [str(t) for t in types]
    layers = int(d.get("num_hidden_layers", 4))
    interval = int(d.get("full_attention_interval", 4))
    return [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]


def tiny_overrides(d: dict[str, Any]) -> dict[str, Any]:
    """The size fields of a Qwen3.5-MoE-style config, made tiny; every other field is kept.

    Layers: the shortest prefix of the layer pattern holding both layer kinds (at most 8). Query
    heads 4 with the grouping kept (MHA, 2 or 4+ q per kv); GDN key heads 2 with the v/k head ratio
    kept (up to 4); head dims unchanged.
    """
    types = _layer_types(d)
    n = next(
        (i + 1 for i in range(len(types)) if len(set(types[: i + 1])) >= 2),
        min(len(types), 2),
    )
    n = max(1, min(n, MAX_TINY_LAYERS))
    heads = int(d.get("num_attention_heads", 16))
    kv = int(d.get("num_key_value_heads") or heads)
    groups = max(1, heads // max(kv, 1))
    head_dim = int(d.get("head_dim") or int(d.get("hidden_size", 2048)) // heads)
    k_heads = int(d.get("linear_num_key_heads", 16))
    ratio = max(1, int(d.get("linear_num_value_heads", 32)) // max(k_heads, 1))
    top_k = int(d.get("num_experts_per_tok", TINY_TOP_K) or TINY_TOP_K)
    out: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=TINY_HIDDEN,
        num_hidden_layers=n,
        layer_types=types[:n],
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_HEADS // min(groups, TINY_HEADS),
        head_dim=head_dim,
        linear_num_key_heads=TINY_LINEAR_KEY_HEADS,
        linear_num_value_heads=TINY_LINEAR_KEY_HEADS * min(ratio, 4),
        num_experts=TINY_EXPERTS if int(d.get("num_experts", 1) or 0) else 0,
        num_experts_per_tok=min(top_k, TINY_TOP_K),
        moe_intermediate_size=TINY_EXPERT_WIDTH,
        dtype="float32",
    )
    if int(d.get("shared_expert_intermediate_size", 1) or 0):
        out["shared_expert_intermediate_size"] = TINY_EXPERT_WIDTH
    if int(d.get("intermediate_size", 0) or 0):
        out["intermediate_size"] = TINY_DENSE_WIDTH
    if "torch_dtype" in d:
        out["torch_dtype"] = "float32"
    if isinstance(d.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in d["mlp_only_layers"] if i < n]
    pad = d.get("pad_token_id")
    if isinstance(pad, int) and pad >= TINY_VOCAB:  # the embedding's padding_idx must exist
        out["pad_token_id"] = None
    return out


def _tiny_config_dict(d: dict[str, Any]) -> dict[str, Any]:
    d = json.loads(json.dumps(d))  # a deep copy
    if isinstance(d.get("text_config"), dict):  # a wrapper config: the trunk is nested
        d["text_config"].update(tiny_overrides(d["text_config"]))
    else:
        d.update(tiny_overrides(d))
    return d


@torch.no_grad()
def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights at a scale where every layer matters: matrices ~ N(0, 1/fan_in), vectors
    (norm offsets, dt_bias, block-diffusion scalars) their initial value + N(0, 0.1).

    The GDN decay rates ``A = exp(A_log)`` are drawn in (0.01, 0.3) rather than transformers'
    init range (0.01, 16): a state that forgets within a row or two would leave the state carried
    across commits untested, and at such rates the chunked delta rule's float32 cumulative decays
    lose ~1e-4 of precision in either implementation (a difference of rounding, not of code).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("A_log"):
            p.copy_(torch.rand(p.shape, generator=gen).mul_(0.29).add_(0.01).log_())
        elif p.dim() >= 2:
            p.copy_(noise * p.shape[-1] ** -0.5)
        else:
            p.add_(0.1 * noise)


def _logits(output: Any) -> torch.Tensor:
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, tuple | list) and output:
        logits = output[0]
    if not isinstance(logits, torch.Tensor):
        raise ReferenceCheckError("the reference model's forward returned no logits")
    return logits.float()


def _our_config(reference_config: Any, with_preview: bool) -> tuple[dict[str, Any], ModelConfig]:
    """The tiny reference config as a ``config.json`` dict of ours, and our reading of it."""
    d = reference_config.to_dict()
    for key in ("auto_map", "architectures"):
        d.pop(key, None)
    d["model_type"] = "clover_moe" if with_preview else "qwen3_5_moe_text"
    try:
        return d, ModelConfig.from_hf_dict(d, allow_causal_trunk=True)
    except (ConfigError, KeyError, TypeError, ValueError) as exc:
        raise ReferenceCheckError(
            f"the reference config is not Qwen3.5-MoE-compatible: {type(exc).__name__}: {_one_line(exc)}"
        ) from exc


def _our_logits(ours: Any, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our plain causal forward, and our prefill followed by block commits through a cache."""
    batch, t = ids.shape
    causal = ours(ids, pos, pos)
    cache = ours.new_cache(max_seqs=batch, max_len=t, device="cpu", dtype=torch.float32)
    slots = torch.tensor([cache.allocate() for _ in range(batch)])
    pieces = []
    for lo, hi in itertools.pairwise(COMMIT_BOUNDARIES):
        commit = torch.full((batch,), hi - lo)
        sl = slice(lo, hi)
        pieces.append(ours(ids[:, sl], pos[:, sl], pos[:, sl], cache=cache, slots=slots, commit_lens=commit))
    return causal, torch.cat(pieces, dim=1)


def check_reference(
    folder: Path | str,
    *,
    seed: int = 0,
    tolerance: float = DEFAULT_TOLERANCE,
    work_dir: Path | None = None,
) -> ReferenceCheckResult:
    """Build a tiny random model from ``folder``'s own code, load its weights into ours, compare.

    Raises ``NoRemoteCodeError`` (no ``auto_map``), ``ReferenceCheckError`` (the check cannot
    run) or ``ReferenceMismatchError`` (its tensors or outputs do not fit ours). ``work_dir``
    keeps the tiny checkpoint (config.json, model.safetensors); a temporary folder otherwise.
    """
    folder = Path(folder)
    config_path = folder / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except FileNotFoundError as exc:
        raise ReferenceCheckError(f"config.json is missing from {folder}") from exc
    except ValueError as exc:
        raise ReferenceCheckError(f"{config_path} is not valid JSON: {_one_line(exc)}") from exc
    if not isinstance(raw, dict):
        raise ReferenceCheckError(f"{config_path} is not a JSON object")
    model_ref, config_ref = remote_code_refs(raw, folder)
    try:
        # deferred: transformers, a heavy test extra; the remote code imports it: fail here, clearly
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ReferenceCheckError(
            "transformers is not installed: it is a test extra (pip install 'cloverq[test]'), "
            "needed to run a folder's own modeling code"
        ) from exc
    with _folder_package(folder.resolve()) as package, _quiet_transformers():
        model_cls = _import_class(folder, package, model_ref)
        config_cls = (
            _import_class(folder, package, config_ref)
            if config_ref
            else getattr(model_cls, "config_class", None)
        )
        if not isinstance(config_cls, type) or not hasattr(config_cls, "from_dict"):
            raise ReferenceCheckError(f"{model_ref} names no config class and auto_map has no {CONFIG_KEY}")
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                reference_config = config_cls.from_dict(_tiny_config_dict(raw))
                reference = model_cls(reference_config).float().eval()
            _randomise(reference, seed)
        except Exception as exc:  # the folder's code
            raise ReferenceCheckError(
                f"the reference model did not build from {folder}: {type(exc).__name__}: {_one_line(exc)}"
            ) from exc
        state = {k: v.detach().clone().contiguous() for k, v in reference.state_dict().items()}
        with_preview = any(k.endswith(tuple(PREVIEW_TENSORS.values())) for k in state)
        config_dict, config = _our_config(reference_config, with_preview)

        with tempfile.TemporaryDirectory(prefix="cloverq-reference-") as tmp:
            out = Path(work_dir) if work_dir is not None else Path(tmp)
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps(config_dict, indent=2, default=str) + "\n")
            weights = out / "model.safetensors"
            save_file(state, str(weights))
            ours = build_empty_model(config, device="cpu", dtype=torch.float32)
            try:
                load_weights(ours, [weights], with_preview=with_preview)
            except CheckpointError as exc:
                raise ReferenceMismatchError(
                    f"the reference model's tensors do not load into ours: {_one_line(exc)}"
                ) from exc

        t = COMMIT_BOUNDARIES[-1]
        gen = torch.Generator().manual_seed(seed + 1)
        ids = torch.randint(0, config.vocab_size, (BATCH, t), generator=gen)
        pos = torch.arange(t).expand(BATCH, -1)
        try:
            with torch.no_grad():
                ref = _logits(reference(input_ids=ids, use_cache=False))
        except ReferenceCheckError:
            raise
        except Exception as exc:  # the folder's code
            raise ReferenceCheckError(
                f"the reference model's forward failed: {type(exc).__name__}: {_one_line(exc)}"
            ) from exc
    try:
        causal, committed = _our_logits(ours, ids, pos)
    except Exception as exc:  # ours, on a config it accepted: still one line, naming the failure
        raise ReferenceMismatchError(
            f"our model failed on the reference's tiny config: {type(exc).__name__}: {_one_line(exc)}"
        ) from exc
    if causal.shape != ref.shape:
        raise ReferenceMismatchError(
            f"the reference returns logits of shape {list(ref.shape)}, ours {list(causal.shape)}"
        )
    return ReferenceCheckResult(
        folder=folder,
        model_class=model_ref,
        config_class=config_ref or f"{config_cls.__module__.rpartition('.')[2]}.{config_cls.__name__}",
        config=config,
        with_preview=with_preview,
        tokens=(BATCH, t),
        causal_diff=(causal - ref).abs().max().item(),
        commit_diff=(committed - ref).abs().max().item(),
        tolerance=tolerance,
    )
