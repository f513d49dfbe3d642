"""Chained passes: a generation row's later answer blocks trained from its first pass's cache.

A training pass of a Clover row commits its whole prefix (a prompt of 200 to 500 tokens) to
learn one block of 4 answer tokens, so a step's generation rows spend nearly all their forward
on prompts. The engine decodes an answer block by block, each pass fusing the commit of the block
just resolved with the preview of the next one (``worker.model.hybrid_model``). A chain does the
same in training: after the row's first pass (prefix committed, block ``n`` previewed) each
further pass commits block ``m - 1``'s clean tokens against the cache built so far and previews
block ``m`` noised, a pass of ``2 * block`` tokens instead of ``m * block``. Gradients run back
through the cache into the prefix, as in one long forward. Only rows without choice slots chain
(generation, tool-call and self-distillation rows): a decision row's blocks are its slots, noised
as the engine serves them (``trainer.served_decision``).

Each pass writes its K/V, conv rings and states into the cache in place, and autograd keeps views
of the cache it read: the next pass writes into a copy (``fork``), so what one pass saved for
backward is never overwritten.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from worker.model.hybrid_cache import HybridCache
from worker.training.certainty import certainty_term
from worker.training.rows import Row


@dataclass(frozen=True)
class Chain:
    """Row ``r``'s chained blocks (``blocks[r]``, consecutive after its first pass's block; empty:
    none) and their tokens: ``clean``/``noisy`` ``[B, W]`` hold every row's ids up to the chain's
    end, ``noisy`` with the chained targets (``masked`` ``[B, W]``) replaced by the mask token."""

    blocks: list[list[int]]
    clean: torch.Tensor
    noisy: torch.Tensor
    masked: torch.Tensor

    @property
    def width(self) -> int:
        """W: the positions up to the end of the longest chain (the cache a chain needs)."""
        return self.clean.shape[1]


def draw_chain(rows: list[Row], commit: torch.Tensor, block: int, mask_id: int, length: int,
               gen: torch.Generator) -> Chain:  # fmt: skip
    """The chains of ``rows`` whose first pass (``commit[r] // block``) is at block ``n``: blocks
    ``n + 1`` up to ``n + length - 1`` while they hold a predicted position, each noised as a first
    pass's block is (a random share of its targets masked, at least one; a ``whole`` row's all)."""
    blocks: list[list[int]] = []
    chosen: list[list[tuple[int, torch.Tensor]]] = []
    for r, row in enumerate(rows):
        row_blocks: list[int] = []
        row_chosen: list[tuple[int, torch.Tensor]] = []
        first = int(commit[r]) // block
        for m in range(first + 1, min(first + length, len(row.ids) // block)):
            if row.units:  # a decision row: its blocks are its slots, noised as served
                break
            targets = torch.tensor(row.predicted[m * block : (m + 1) * block])  # [block]
            if not targets.any():
                break
            if row.whole:
                picked = targets
            else:
                ratio = torch.rand(1, generator=gen)
                picked = targets & (torch.rand(block, generator=gen) < ratio)
                if not picked.any():  # at least one target per block
                    where = targets.nonzero().flatten()
                    picked[where[int(torch.randint(len(where), (1,), generator=gen))]] = True
            row_blocks.append(m)
            row_chosen.append((m, picked))
        blocks.append(row_blocks)
        chosen.append(row_chosen)
    width = max([(b[-1] + 1) * block for b in blocks if b] or [block])
    clean = torch.full((len(rows), width), mask_id)  # [B, W]
    masked = torch.zeros(len(rows), width, dtype=torch.bool)  # [B, W]
    for r, row in enumerate(rows):
        end = min(width, len(row.ids))
        clean[r, :end] = torch.tensor(row.ids[:end])
        for m, picked in chosen[r]:
            masked[r, m * block : (m + 1) * block] = picked
    return Chain(blocks, clean, clean.masked_fill(masked, mask_id), masked)


def fork(cache: HybridCache) -> HybridCache:
    """A copy of ``cache`` whose tensors are clones (tracked by autograd): the next pass writes
    there, leaving the tensors earlier passes read (and saved for backward) as they were. The
    slot bookkeeping (``_free``/``_in_use``) is shared: a chain allocates no slot."""
    twin = copy.copy(cache)
    twin.k = [t.clone() for t in cache.k]
    twin.v = [t.clone() for t in cache.v]
    twin.ring = [t.clone() for t in cache.ring]
    twin.state = [t.clone() for t in cache.state]
    twin.lengths = cache.lengths.clone()
    twin.current = cache.current.clone()
    return twin


def chain_loss(
    model: Any,
    cache: HybridCache,
    slots: torch.Tensor,  # [b] the cache slots of ``rows``
    rows: list[int],  # the batch rows of the pass that built ``cache``, in its order
    chain: Chain,
    weight: torch.Tensor,  # [B, >= chain.width] each target's loss weight
    block: int,
    certainty: torch.Tensor | None = None,  # [B, >= chain.width] each target's certainty weight
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed weighted cross-entropy, summed weight) over the chained targets of ``rows``, one
    fused pass per chain link after the pass that left ``cache`` (committed up to each row's
    first block); with ``certainty``, the certainty term (``worker.training.certainty``) added to
    the sum, not to the weight."""
    forward = type(model).forward.__wrapped__  # the forward without its no_grad
    total, weight_sum = torch.zeros(()), torch.zeros(())
    link = 0
    while True:
        live = [i for i, r in enumerate(rows) if len(chain.blocks[r]) > link]
        if not live:
            return total, weight_sum
        batch_rows = torch.tensor([rows[i] for i in live])  # [R]
        m = torch.tensor([chain.blocks[rows[i]][link] for i in live])  # [R] the previewed block
        span = torch.arange(2 * block)  # [2b]: block m - 1 committed, block m previewed
        cols = (m[:, None] - 1) * block + span[None, :]  # [R, 2b]
        ids = torch.cat((chain.clean[batch_rows[:, None], cols[:, :block]],
                         chain.noisy[batch_rows[:, None], cols[:, block:]]), dim=1)  # [R, 2b] fmt: skip
        cache = fork(cache)
        preview = torch.arange(block, 2 * block).expand(len(live), -1)  # [R, b]
        commits = torch.full((len(live),), block)  # [R]
        logits = forward(model, ids, cols, valid=None, cache=cache, slots=slots[live], commit_lens=commits,
                         logits_index=preview)  # [R, b, V] fmt: skip
        at = (batch_rows[:, None], cols[:, block:])  # the previewed block's positions, [R, b] each
        gold = chain.clean[at]  # [R, b]
        counted = chain.masked[at] * weight[at]  # [R, b]
        ce = F.cross_entropy(logits.flatten(0, 1), gold.flatten(), reduction="none").view_as(gold)
        total = total + (ce * counted).sum()
        weight_sum = weight_sum + counted.sum()
        if certainty is not None:
            total = total + (certainty_term(logits, gold) * chain.masked[at] * certainty[at]).sum()
        link += 1
