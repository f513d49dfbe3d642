"""What a Hugging Face checkpoint folder says about how to run it: dtype and generation defaults.

- **dtype**: ``config.json``'s ``dtype`` (transformers 5) or ``torch_dtype`` (older), also inside a
  nested ``text_config``; ``CLOVERQ_DTYPE`` overrides it; float32 when the config names none.
- **generation defaults**: ``generation_config.json``'s ``do_sample``, ``temperature``, ``top_p``,
  ``top_k`` and ``max_new_tokens`` (plus the block-diffusion keys some checkpoints add:
  ``block_size``/``block_length``, ``steps_per_block``, ``threshold``; and cloverq's own
  ``joint_decode``, how the checkpoint's joint decisions decode best). ``cloverq
  generate`` uses them for every flag it is not given; the worker logs them at load. API jobs do
  not inherit them: a job's row records what it runs with (``api/limits.py`` fills the
  deployment's defaults at submit, greedy unless the request says otherwise); the exception is
  ``joint_decode``, which the worker follows under ``CLOVERQ_DECIDE_JOINT_DECODE=auto`` (how the
  checkpoint was trained to be read, not a sampling choice of the job). Keys cloverq has no
  knob for (``repetition_penalty``, ``min_p``, ...) are listed as ``unsupported`` and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from worker.model.config import ConfigError, ModelConfig

JOINT_DECODES = ("blockwise", "one_pass")
DEFAULT_DTYPE = "float32"  # when neither the config nor CLOVERQ_DTYPE names one
_DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}  # fmt: skip
# generation_config keys that change sampling but that cloverq has no knob for (ignored, logged)
_UNSUPPORTED_SAMPLING_KEYS = ("repetition_penalty", "min_p", "typical_p", "presence_penalty",
                              "frequency_penalty", "no_repeat_ngram_size", "num_beams")


def checkpoint_dtype_name(config: ModelConfig) -> str | None:
    """The dtype ``config.json`` names (normalised: float32, bfloat16, float16), None if none.

    Raises ``ConfigError`` for a dtype cloverq cannot compute in (e.g. float8 without a
    quantization path): set ``CLOVERQ_DTYPE`` to load it in another one.
    """
    raw = config.extra.get("dtype") or config.extra.get("torch_dtype")
    if raw is None or raw == "auto":
        return None
    name = str(raw).removeprefix("torch.")
    if name not in _DTYPE_ALIASES:
        known = ", ".join(sorted(set(_DTYPE_ALIASES.values())))
        raise ConfigError(f"dtype={raw!r} in config.json is not one of {known}: set CLOVERQ_DTYPE")
    return _DTYPE_ALIASES[name]


def resolve_dtype(config: ModelConfig | None, override: str | None = None) -> torch.dtype:
    """``override`` (CLOVERQ_DTYPE / --dtype) if given, else the checkpoint's, else float32."""
    name = _DTYPE_ALIASES.get(override, override) if override else None
    name = name or (checkpoint_dtype_name(config) if config is not None else None) or DEFAULT_DTYPE
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown dtype {name!r}")
    return dtype


def _number(value: Any, kind: type) -> Any:
    try:
        return None if value is None or isinstance(value, bool) else kind(value)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class GenerationDefaults:
    """The decoding defaults a checkpoint ships in ``generation_config.json`` (None: not given)."""

    temperature: float | None = None  # 0.0 when do_sample is false (greedy)
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    block_size: int | None = None
    steps_per_block: int | None = None
    threshold: float | None = None
    # how a joint decision decodes best, "blockwise" or "one_pass" (a cloverq key: the worker's
    # CLOVERQ_DECIDE_JOINT_DECODE=auto follows it; docs/decisions.md)
    joint_decode: str | None = None
    unsupported: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, gen: dict[str, Any]) -> GenerationDefaults:
        do_sample = gen.get("do_sample")
        temperature = _number(gen.get("temperature"), float)
        if do_sample is False:
            temperature = 0.0  # transformers ignores temperature/top_p/top_k without sampling
        elif do_sample is True and temperature is None:
            temperature = 1.0  # transformers' default temperature when sampling
        top_k = _number(gen.get("top_k"), int)
        top_p = _number(gen.get("top_p"), float)
        return cls(
            temperature=temperature,
            top_p=top_p if top_p is not None and 0.0 < top_p < 1.0 else None,  # 1.0 = no nucleus cut
            top_k=top_k if top_k else None,  # 0 = no top-k cut
            max_new_tokens=_number(gen.get("max_new_tokens"), int),
            block_size=_number(gen.get("block_size", gen.get("block_length")), int),
            steps_per_block=_number(gen.get("steps_per_block"), int),
            threshold=_number(gen.get("threshold"), float),
            joint_decode=gen["joint_decode"] if gen.get("joint_decode") in JOINT_DECODES else None,
            unsupported={k: gen[k] for k in _UNSUPPORTED_SAMPLING_KEYS
                         if gen.get(k) not in (None, 1, 1.0, 0, 0.0)}
            | ({"joint_decode": gen["joint_decode"]}
               if gen.get("joint_decode") not in (None, *JOINT_DECODES) else {}),  # logged, not followed
        )

    def as_log(self) -> dict[str, Any]:
        """The non-empty defaults (for a log line)."""
        keys = ("temperature", "top_p", "top_k", "max_new_tokens", "block_size", "steps_per_block",
                "threshold", "joint_decode")
        values = {k: getattr(self, k) for k in keys}
        out: dict[str, Any] = {k: v for k, v in values.items() if v is not None}
        if self.unsupported:
            out["unsupported"] = self.unsupported
        return out
