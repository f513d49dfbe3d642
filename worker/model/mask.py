"""The block-causal attention mask of one forward (cache part + new part), built once per forward.

New token ``i`` sees every committed cache entry of its row's slot, and new token ``j`` iff
``valid[j]`` and ``block_ids[j] <= block_ids[i]``. Passing ``block_ids = positions`` gives the
plain causal mask. Every query also sees itself, so a padding row never has an empty softmax.
"""

from __future__ import annotations

import torch


def block_causal_mask(
    block_ids: torch.Tensor,  # [B, T]
    valid: torch.Tensor | None,  # [B, T] bool
    cached_lengths: torch.Tensor | None,  # [B] committed positions per row
    context_len: int,  # C: cache columns in front of the new ones
) -> torch.Tensor:  # [B, 1, T, C + T] bool, True = may attend
    b, t = block_ids.shape
    device = block_ids.device
    new = block_ids[:, None, :] <= block_ids[:, :, None]  # [B, Tq, Tk]
    if valid is not None:
        new = new & valid[:, None, :]
    new = new | torch.eye(t, dtype=torch.bool, device=device)  # a query always sees itself
    if context_len == 0 or cached_lengths is None:
        return new[:, None]
    cols = torch.arange(context_len, device=device)  # [C]
    cached = (cols[None, :] < cached_lengths[:, None])[:, None, :].expand(b, t, context_len)  # [B, T, C]
    return torch.cat((cached, new), dim=-1)[:, None]
