"""Rotary position embeddings (the "default" rope type: half-split rotation, as in Qwen3).

Angles come from absolute positions per token, so rows of a batch may sit at different offsets
(each row continues its own cached sequence). ``cos``/``sin`` are computed once per forward in
the layout the projections produce (``[B, T, 1, D]``, contiguous heads: elementwise ops on the
transposed ``[B, H, T, D]`` view were ~30% slower) and ``sin`` carries the rotation's sign, so each
layer's rotation is three small ops (cat, mul, addcmul) instead of eight.
"""

from __future__ import annotations

import torch

# inverse frequencies [D/2] per (head_dim, theta, device): built once, not on every forward
_INV_FREQ: dict[tuple[int, float, torch.device], torch.Tensor] = {}
_INV_FREQ_LIMIT = 16  # bounded: a process serves a handful of models and devices


def _inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """``1 / theta ** (2i / head_dim)`` for i < head_dim / 2: ``[D/2]`` float32 (cached)."""
    key = (head_dim, float(theta), device)
    inv = _INV_FREQ.get(key)
    if inv is None:
        if len(_INV_FREQ) >= _INV_FREQ_LIMIT:
            _INV_FREQ.clear()
        exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim
        inv = _INV_FREQ[key] = 1.0 / (theta**exponent)  # [D/2]
    return inv


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, signed_sin`` of shape ``[B, T, 1, head_dim]`` for integer ``positions`` ``[B, T]``.

    ``signed_sin`` is ``sin`` with its first half negated: ``rotate_half(x) * sin`` equals
    ``swap_halves(x) * signed_sin`` exactly (a sign flip is exact in every dtype).
    """
    inv_freq = _inv_freq(head_dim, theta, positions.device)  # [D/2]
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    sin = emb.sin().to(dtype)
    half = head_dim // 2
    sin[..., :half] = -sin[..., :half]
    return emb.cos().to(dtype)[:, :, None], sin[:, :, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, T, H, D]`` by ``cos/signed_sin`` ``[B, T, 1, D]`` from ``rope_cos_sin``."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # [B, T, H, D]
    return torch.addcmul(x * cos, swapped, signed_sin)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the leading ``cos.shape[-1]`` dims of ``x`` ``[B, T, H, D]``; the rest pass through.

    Qwen3.5's partial RoPE (``partial_rotary_factor``): the tables come from
    ``rope_cos_sin(positions, rotary_dim, ...)``, the half-split rotation acts inside those dims.
    """
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return apply_rope(x, cos, signed_sin)
    return torch.cat((apply_rope(x[..., :rot], cos, signed_sin), x[..., rot:]), dim=-1)
