"""RMSNorm as Qwen3 computes it (statistics in float32, scale applied in the input dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused kernel instead of five small ones (per-op overhead dominates small passes);
            # in float32 it is the same arithmetic as the path below
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class OffsetRMSNorm(nn.Module):
    """Qwen3.5's zero-centred RMSNorm: the scale is ``1 + weight`` (weights stored around 0).

    Computed in float32 and cast back, as the trunk does ((x * w) in fp32, then the input dtype).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        scale = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), scale, self.eps).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The Gated DeltaNet output norm: RMSNorm with a plain ``weight``, then ``x silu(z)``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # [..., dim] each
        dtype = x.dtype
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(dtype)
        return (self.weight * normed * F.silu(z.float())).to(dtype)
