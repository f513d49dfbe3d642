"""Block-causal attention masks, built once per forward and shared by every layer.

New token ``i`` sees new token ``j`` iff ``valid[j]`` and ``block_ids[j] <= block_ids[i]``
(``block_ids = positions`` gives the plain causal mask), plus every committed cache entry of its
row. Every query also sees itself, so a padding row never has an empty softmax (no NaN).
"""

from __future__ import annotations

import torch

# [N] 0..N-1 per device, grown on demand: the index vectors of every mask (and the identity)
# are slices of it instead of fresh ``arange``/``eye`` tensors on every forward
_ARANGE: dict[torch.device, torch.Tensor] = {}


def _iota(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` (int64) on ``device`` as a slice of one cached tensor: ``[n]``."""
    cached = _ARANGE.get(device)
    if cached is None or cached.numel() < n:
        if len(_ARANGE) >= 16:  # bounded: a handful of devices per process
            _ARANGE.clear()
        cached = _ARANGE[device] = torch.arange(max(1 << max(n - 1, 0).bit_length(), 64), device=device)
    return cached[:n]


def block_causal_mask(block_ids: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Mask of a forward without cache: ``[B, 1, T, T]`` bool, True = may attend."""
    t = block_ids.shape[1]
    new = block_ids[:, None, :] <= block_ids[:, :, None]  # [B, Tq, Tk]
    if valid is not None:
        new = new & valid[:, None, :]
    iota = _iota(t, block_ids.device)
    itself = iota[:, None] == iota[None, :]  # [T, T] the identity
    return (new | itself)[:, None]


def cached_block_causal_mask(
    block_ids: torch.Tensor,  # [B, T]
    valid: torch.Tensor | None,  # [B, T] bool
    lengths: torch.Tensor,  # [B] committed positions per row
    key_len: int,  # S: cache columns the forward attends over
) -> torch.Tensor:  # [B, 1, T, S] bool
    """Mask in cache coordinates: row ``b``'s new token ``t`` is stored at column ``lengths[b] + t``.

    Column ``j`` of row ``b`` holds a committed entry when ``j < lengths[b]``, new token
    ``j - lengths[b]`` when that is in ``[0, T)``, and stale data (never visible) beyond.
    """
    t = block_ids.shape[1]
    device = block_ids.device
    rel = _iota(key_len, device)[None, :] - lengths[:, None]  # [B, S] new-token index
    is_new = (rel >= 0) & (rel < t)  # [B, S]
    rel_c = rel.clamp(0, t - 1)
    key_block = block_ids.gather(1, rel_c)  # [B, S]
    visible = is_new[:, None, :] & (key_block[:, None, :] <= block_ids[:, :, None])  # [B, T, S]
    if valid is not None:
        visible = visible & valid.gather(1, rel_c)[:, None, :]
    committed = (rel < 0)[:, None, :]  # [B, 1, S]
    itself = rel[:, None, :] == _iota(t, device)[None, :, None]  # [B, T, S]
    return (visible | committed | itself)[:, None]


def grouped_additive_bias(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, T, S]`` bool mask -> ``[B, 1, G*T, S]`` additive bias (0 / -inf) in ``dtype``.

    Attention folds the ``G`` query heads that share a KV head into the query axis
    (``[B, KVH, G*T, D]``), so K/V are never repeated; the bias repeats the mask ``G`` times to
    match. An additive bias is also the faster input for the CPU SDPA kernel.
    """
    b, _, t, s = mask.shape
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias[:, :, None].expand(b, 1, groups, t, s).reshape(b, 1, groups * t, s)
