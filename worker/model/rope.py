"""Rotary position embeddings (the "default" rope type: half-split rotation, as in Qwen3).

Angles come from absolute positions per token, so rows of a batch may sit at different offsets
(each row continues its own cached sequence).
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[B, T, head_dim]`` for integer ``positions`` ``[B, T]``."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)  # [D/2]
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, H, T, D]`` by ``cos/sin`` ``[B, T, D]``."""
    cos = cos[:, None]  # [B, 1, T, D]
    sin = sin[:, None]
    return x * cos + _rotate_half(x) * sin
