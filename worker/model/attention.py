"""Grouped-query attention with per-head q/k RMSNorm and RoPE, reading and appending the KV cache.

The new positions of a forward attend to the row's committed cache entries plus the new
positions the block-causal mask allows; the mask is planned once per forward (``attend.py``:
a dense bias, or for one row over a committed prefix, no mask over the prefix at all).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from worker.model.attend import AttentionPlan, attend
from worker.model.config import ModelConfig
from worker.model.kv_cache import CacheFullError, KVCache
from worker.model.norm import RMSNorm
from worker.model.rope import apply_partial_rope


@dataclass(frozen=True)
class CacheView:
    """Where one forward stores its new K/V and which cache columns it attends over.

    The new positions of row ``b`` are written in place at ``lengths[b] + t`` before attention
    (beyond the committed length they are invisible to later forwards until committed), so
    attention reads the cache directly: a zero-copy view when the rows' slots are one ascending
    run, otherwise one gather. Committing is then only advancing ``lengths``.
    """

    cache: KVCache
    slots: torch.Tensor  # [B] slot of each row
    key_len: int  # S: cache columns attended over (max lengths + T, GPU: rounded up to 8; <= max_len)
    slot_start: int | None  # first slot when slots == range(slot_start, slot_start + B)
    write_slots: torch.Tensor  # [B, 1] or [N] destination slot of each new position written
    write_pos: torch.Tensor  # [B, T] or [N] destination column
    write_rows: torch.Tensor | None  # None: every new position is written; else [N] row ...
    write_cols: torch.Tensor | None  # ... and [N] new-token index of each written position
    committed: tuple[int, ...] = ()  # each row's committed length before the forward, on the host

    def rows_of(self, layer_cache: torch.Tensor) -> torch.Tensor:
        """The batch's rows of one layer's cache up to ``key_len``: ``[B, KVH, S, D]``."""
        if self.slot_start is not None:
            return layer_cache[self.slot_start : self.slot_start + self.slots.shape[0], :, : self.key_len]
        return layer_cache[self.slots, :, : self.key_len]

    def store(self, layer_cache: torch.Tensor, new: torch.Tensor) -> None:
        """Write ``new`` ``[B, KVH, T, D]`` at the rows' next columns of ``layer_cache``."""
        new = new.to(layer_cache.dtype)
        if self.write_rows is None:
            # two advanced indices around a slice: indexed dims first -> [B, T, KVH, D]
            layer_cache[self.write_slots, :, self.write_pos] = new.transpose(1, 2)
        else:
            layer_cache[self.write_slots, :, self.write_pos] = new[self.write_rows, :, self.write_cols]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.groups = config.kv_groups
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
        cos: torch.Tensor,  # [B, T, 1, R] (rope_cos_sin; R = rotary dims, D unless partial)
        sin: torch.Tensor,  # [B, T, 1, R] signed sin (rope_cos_sin)
        plan: AttentionPlan,  # the forward's mask: dense [B, 1, G*T, S] bias or split (attend.py)
        view: CacheView | None,
    ) -> torch.Tensor:  # [B, T, hidden]
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim))  # [B, T, H, D]
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim))  # [B, T, KVH, D]
        q = apply_partial_rope(q, cos, sin).transpose(1, 2)  # [B, H, T, D] (rotated while contiguous)
        k = apply_partial_rope(k, cos, sin).transpose(1, 2)  # [B, KVH, T, D]
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)

        keys, values = k, v  # [B, KVH, T, D]
        if view is not None:
            view.store(view.cache.k[self.layer], k)
            view.store(view.cache.v[self.layer], v)
            keys = view.rows_of(view.cache.k[self.layer]).to(q.dtype)  # [B, KVH, S, D] (no-op if same dtype)
            values = view.rows_of(view.cache.v[self.layer]).to(q.dtype)

        out = attend(q, keys, values, plan).transpose(1, 2)  # [B, T, H, D]
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))


def build_cache_view(
    t: int,
    cache: KVCache | None,
    slots: torch.Tensor | None,
    commit_lens: torch.Tensor | None,
    valid: torch.Tensor | None,
) -> tuple[CacheView | None, torch.Tensor | None, list[int], list[int]]:
    """Where each row's new K/V go and what it reads, plus each row's commit length and valid
    token count on the host (one host sync for lengths, counts and bounds)."""
    counts = valid.sum(dim=1) if valid is not None else None
    if cache is None:
        if commit_lens is not None:
            raise ValueError("commit_lens needs a cache")
        return None, None, [], [] if counts is None else counts.tolist()
    if slots is None:
        raise ValueError("slots are required with a cache")
    slots = slots.to(device=cache.device, dtype=torch.long)
    lengths = cache.lengths[slots]  # [B]
    b = slots.shape[0]
    commits = torch.zeros_like(lengths) if commit_lens is None else commit_lens.to(lengths)
    if counts is None:
        counts = torch.full_like(lengths, t)
    host = torch.cat((slots, lengths, commits, counts.to(lengths))).tolist()
    slot_list, len_list = host[:b], host[b : 2 * b]
    commit_list, count_list = host[2 * b : 3 * b], host[3 * b :]
    if max(commit_list) > t:
        raise ValueError(f"commit_lens asks for {max(commit_list)} positions of a {t}-position forward")
    if max(n + c for n, c in zip(len_list, commit_list, strict=True)) > cache.max_len:
        raise CacheFullError(f"committing would pass the cache's {cache.max_len} positions per slot")
    start = slot_list[0]
    contiguous = slot_list == list(range(start, start + b))
    # on GPU rounded up to a multiple of 8 columns (masked) so attention kernels get aligned
    # rows; on CPU every extra column is only extra work
    align = 1 if cache.device.type == "cpu" else 8
    key_len = min(cache.max_len, -(-(max(len_list) + t) // align) * align)
    cols = torch.arange(t, device=cache.device)  # [T]
    pos = lengths[:, None] + cols[None, :]  # [B, T] destination columns
    rows = write_cols = None
    write_slots, write_pos = slots[:, None], pos
    if max(len_list) + t > cache.max_len:  # some positions have no room: padding may be skipped
        fits = pos < cache.max_len  # [B, T]
        if bool((~fits & (True if valid is None else valid)).any()):
            raise CacheFullError(f"a real new position would pass the cache's {cache.max_len} positions")
        rows, write_cols = fits.nonzero(as_tuple=True)  # [N], [N]
        write_slots, write_pos = slots[rows], pos[rows, write_cols]
    view = CacheView(
        cache=cache,
        slots=slots,
        key_len=key_len,
        slot_start=start if contiguous else None,
        write_slots=write_slots,
        write_pos=write_pos,
        write_rows=rows,
        write_cols=write_cols,
        committed=tuple(len_list),
    )
    return view, lengths, commit_list, count_list
