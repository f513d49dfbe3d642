"""Pre-quantized FP8 checkpoints with block scales (the format of Qwen3's FP8 releases).

A quantized matrix ``X.weight`` is stored as ``float8_e4m3fn`` next to ``X.weight_scale_inv``, one
float32 factor per block of ``weight_block_size`` (``[128, 128]`` unless the config's
``quantization_config`` says otherwise) of its last two dims; a partial block at the edge has a
factor of its own. The real weight is ``fp8 * scale_inv`` broadcast over each block (the name
notwithstanding, the stored factor *multiplies*, as in DeepSeek-V3's and Qwen3's reference
``weight_dequant``). Tensors left in high precision (embeddings, norms, routers, LM head) carry no
scale. ``checkpoint.load_weights`` dequantizes each such tensor as it reads it, so the model holds
the configured dtype (or is re-quantized to int8/int4 by ``CLOVERQ_WEIGHT_DTYPE``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from safetensors import safe_open

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
DEFAULT_BLOCK: tuple[int, int] = (128, 128)
FP8_DTYPES: frozenset[torch.dtype] = frozenset(
    d for d in (getattr(torch, n, None) for n in ("float8_e4m3fn", "float8_e5m2")) if d is not None
)


def block_size(config_extra: dict[str, Any]) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of a config (``[128, 128]`` when absent)."""
    qc = config_extra.get("quantization_config") or {}
    block = qc.get("weight_block_size") or DEFAULT_BLOCK
    return int(block[0]), int(block[1])


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 ``weight`` ``[..., N, K]`` from its FP8 codes and ``scale_inv``
    ``[..., ceil(N/bn), ceil(K/bk)]``."""
    n, k = weight.shape[-2:]
    bn, bk = block
    expected = (*weight.shape[:-2], math.ceil(n / bn), math.ceil(k / bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale shape {list(scale_inv.shape)} does not match weight {list(weight.shape)} "
                         f"in blocks of {bn}x{bk} (expected {list(expected)})")
    scale = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return weight.float() * scale


def quantize(
    weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[N, K]`` -> (``float8_e4m3fn`` codes, float32 ``scale_inv`` per block): the inverse of
    ``dequantize``, for writing test checkpoints in the published format."""
    n, k = weight.shape
    bn, bk = block
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = weight.float()
    blocks = padded.view(rows, bn, cols, bk)
    amax = blocks.abs().amax(dim=(1, 3))  # [rows, cols]
    fmax = torch.finfo(torch.float8_e4m3fn).max  # 448
    scale_inv = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    codes = (blocks / scale_inv[:, None, :, None]).view(rows * bn, cols * bk)[:n, :k]
    return codes.to(torch.float8_e4m3fn), scale_inv


def read_scale(f: Any, name: str, found: dict[str, Any]) -> torch.Tensor | None:
    """``name``'s ``scale_inv`` from the open safetensors file ``f`` or, in a sharded checkpoint, from
    the file ``found`` (tensor name -> file) says holds it; ``None`` when the checkpoint has none."""
    scale = scale_name(name)
    if scale not in found:
        return None
    if scale in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
        return f.get_tensor(scale)
    with safe_open(str(found[scale]), framework="pt", device="cpu") as other:
        return other.get_tensor(scale)
