"""Chunked prefill: which rows join a denoising pass, and which prefill a chunk of their prompt.

Without it, a new sequence feeds its prompt's whole blocks in its first pass, batched with every
running sequence: while a 4K-token prompt prefills, every other job's next block waits for that
one long forward (issue 26 measured 799 ms for an 8-token job on the tiny demo; on a real model a
100K-token prompt holds everyone for seconds). With a per-pass token budget, a prompt whose
uncached whole blocks exceed what the pass has left prefills *chunks* of whole blocks instead,
one per engine iteration (``ModelRunner.run_prefill``: the same commit forward, on its own), and
joins the denoising passes once what is left fits. Every iteration still runs the pass for the
rows already decoding, and the engine admits and interrupts (cancel, deadline) between chunks,
so a short job admitted behind a long prompt starts after one chunk, not after the whole prompt.

Exactness: a chunk commits exactly the K/V (and, for Clover, the Gated DeltaNet state and conv
ring, carried from chunk to chunk by the recurrent forward) that the fused first pass would
have; block-causal attention makes the later passes' outputs the same (the prefix cache relies
on the same property). Chunks consume no randomness, so seeded rows decode the same tokens too.

The rule, per iteration, over the active rows in admission order (oldest first):

* a row feeding at most one block (decoding: the block it just finished) always joins the pass;
* a prompt row joins if its uncached blocks fit in what the budget has left;
* else it prefills the largest whole-block chunk that fits; the oldest such row gets at least
  one block even when the budget is spent, so a long prompt always advances.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillPlan:
    """Per active row: whether it joins this pass, and the prompt tokens it prefills before."""

    joins: list[bool]
    chunks: list[int]


def plan_prefill(pending: Sequence[int], block_sizes: Sequence[int], budget: int) -> PrefillPlan:
    """The plan for one iteration (see the module docstring).

    ``pending[i]``: the committed-but-uncached tokens row ``i`` would feed in a pass (its prompt's
    whole blocks before the first pass, one block after each completed block), a multiple of its
    ``block_sizes[i]``. ``budget`` <= 0: chunking off (every row joins, as without this module).
    """
    if budget <= 0:
        return PrefillPlan([True] * len(pending), [0] * len(pending))
    left = budget
    joins: list[bool] = []
    chunks: list[int] = []
    advanced = False  # a prompt row got a chunk this iteration
    for tokens, block in zip(pending, block_sizes, strict=True):
        if tokens <= block or tokens <= left:
            joins.append(True)
            chunks.append(0)
            left -= tokens
            continue
        chunk = max(left, 0) // block * block
        if chunk == 0 and not advanced:
            chunk = block  # the oldest waiting prompt always moves
        chunk = min(chunk, tokens)
        joins.append(False)
        chunks.append(chunk)
        left -= chunk
        advanced = advanced or chunk > 0
    return PrefillPlan(joins, chunks)
