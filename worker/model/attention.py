"""Grouped-query attention with per-head q/k RMSNorm and RoPE, reading and appending the KV cache.

The new positions of a forward attend to the row's committed cache entries plus the new
positions the block-causal mask allows; the mask is built once per forward (see ``mask.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.config import ModelConfig
from worker.model.kv_cache import KVCache
from worker.model.norm import RMSNorm
from worker.model.rope import apply_rope


@dataclass(frozen=True)
class CacheView:
    """What one forward reads from and writes to the KV cache (shared by every layer)."""

    cache: KVCache
    slots: torch.Tensor  # [B] slot of each row
    context_len: int  # C: cached positions gathered per row (max over rows; shorter rows masked)
    write_rows: torch.Tensor | None  # [N] batch row of each position to append
    write_cols: torch.Tensor | None  # [N] index among the new positions
    write_slots: torch.Tensor | None  # [N] destination slot
    write_pos: torch.Tensor | None  # [N] destination position inside the slot


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [B, T, D]
        sin: torch.Tensor,  # [B, T, D]
        mask: torch.Tensor,  # [B, 1, T, C + T] bool, True = may attend
        view: CacheView | None,
    ) -> torch.Tensor:  # [B, T, hidden]
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)  # [B, H, T, D]
        k = apply_rope(k, cos, sin)  # [B, KVH, T, D]

        keys, values = k, v
        if view is not None:
            if view.context_len > 0:
                cached_k = view.cache.k[self.layer][view.slots, :, : view.context_len]  # [B, KVH, C, D]
                cached_v = view.cache.v[self.layer][view.slots, :, : view.context_len]
                keys = torch.cat((cached_k, k), dim=2)  # [B, KVH, C + T, D]
                values = torch.cat((cached_v, v), dim=2)
            if view.write_rows is not None:
                # advanced indices around a slice: the indexed dims come first -> [N, KVH, D]
                view.cache.k[self.layer][view.write_slots, :, view.write_pos] = k[
                    view.write_rows, :, view.write_cols
                ].to(view.cache.dtype)
                view.cache.v[self.layer][view.write_slots, :, view.write_pos] = v[
                    view.write_rows, :, view.write_cols
                ].to(view.cache.dtype)

        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
        )  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))
