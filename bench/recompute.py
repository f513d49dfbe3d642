"""Logits of one block with everything recomputed from scratch: the no-cache reference that the
engine's cached, batched, fused passes are checked against (tests) and timed against (bench).

For SDAR-MoE it is one forward over the whole prefix under the block-causal mask. For Clover it
is a fresh state cache, the causal commit of every position before the block and the preview of
the block, in one forward: nothing carried over from earlier passes.
"""

from __future__ import annotations

import torch

from worker.model.family import DiffusionModel


def block_logits(model: DiffusionModel, seqs: torch.Tensor, lo: int, hi: int, block: int) -> torch.Tensor:
    """Logits ``[B, hi - lo, V]`` of positions ``lo..hi-1`` given ``seqs[:, :hi]`` (no cache)."""
    b = seqs.shape[0]
    pos = torch.arange(hi).expand(b, -1)  # [B, hi]
    if model.config.family != "clover":
        return model(seqs[:, :hi], pos, pos // block)[:, lo:hi]
    param = next(model.parameters())
    cache = model.new_cache(max_seqs=b, max_len=hi, device=param.device, dtype=param.dtype)
    slots = torch.tensor([cache.allocate() for _ in range(b)])
    index = torch.arange(lo, hi).expand(b, -1)  # [B, hi - lo]
    return model(
        seqs[:, :hi],
        pos,
        pos // block,
        cache=cache,
        slots=slots,
        commit_lens=torch.full((b,), lo),
        logits_index=index,
    )
