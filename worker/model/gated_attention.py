"""Clover's full-attention layer: Qwen3.5's gated attention with partial RoPE.

Differences from the SDAR layer (``attention.py``): ``q_proj`` emits, per head, ``head_dim`` query
rows then ``head_dim`` gate rows, and the attention output is multiplied by ``sigmoid(gate)``
before ``o_proj``; q/k norms are zero-centred (``1 + w``); RoPE rotates only the leading
``rotary_dim`` dims of each head. The mask (token-causal commits, a bidirectional preview block
over everything committed) is planned once per forward by the model (``attend.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from worker.model.attend import AttentionPlan, attend
from worker.model.attention import CacheView
from worker.model.config import ModelConfig
from worker.model.norm import OffsetRMSNorm
from worker.model.rope import apply_partial_rope


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, kv_index: int) -> None:
        super().__init__()
        self.kv_index = kv_index  # this layer's position among the attention layers (cache lists)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.groups = config.kv_groups
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(h, 2 * self.num_heads * d, bias=bias)  # per head: query rows, gate rows
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = OffsetRMSNorm(d, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(d, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [B, T, 1, R] (R = rotary dims)
        sin: torch.Tensor,  # [B, T, 1, R] signed sin
        plan: AttentionPlan,  # the forward's mask (attend.py)
        view: CacheView | None,
    ) -> torch.Tensor:  # [B, T, hidden]
        b, t, _ = x.shape
        query, gate = self.q_proj(x).view(b, t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_partial_rope(self.q_norm(query), cos, sin).transpose(1, 2)  # [B, H, T, D]
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim))
        k = apply_partial_rope(k, cos, sin).transpose(1, 2)  # [B, KVH, T, D]
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)

        keys, values = k, v
        if view is not None:
            view.store(view.cache.k[self.kv_index], k)
            view.store(view.cache.v[self.kv_index], v)
            keys = view.rows_of(view.cache.k[self.kv_index]).to(q.dtype)  # [B, KVH, S, D]
            values = view.rows_of(view.cache.v[self.kv_index]).to(q.dtype)

        out = attend(q, keys, values, plan).transpose(1, 2)  # [B, T, H, D]
        out = out.reshape(b, t, self.num_heads * self.head_dim) * torch.sigmoid(gate.reshape(b, t, -1))
        return self.o_proj(out)
