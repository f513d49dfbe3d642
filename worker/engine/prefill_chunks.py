"""Chunked prefill: which rows join a denoising pass, and which prefill a chunk of their prompt.

Without it, a new sequence feeds its prompt's whole blocks in its first pass, batched with every
running sequence: while a 4K-token prompt prefills, every other job's next block waits for that
one long forward (issue 26 measured 799 ms for an 8-token job on the tiny demo; on a real model a
100K-token prompt holds everyone for seconds). With a per-pass budget, a prompt whose
uncached whole blocks exceed what the pass has left prefills *chunks* of whole blocks instead,
one per engine iteration (``ModelRunner.run_prefill``: the same commit forward, on its own), and
joins the denoising passes once what is left fits.

The budget is counted in *work*, not tokens (``forward_cost.ForwardCost``: ``T * (S + W)``
key-equivalents): ``CLOVERQ_ENGINE_PREFILL_CHUNK_TOKENS`` is the prompt tokens a chunk carries at
the start of a prompt, and deeper into a long prompt a chunk carries fewer, so that every chunk
costs about the budget's forward. Counted in tokens, a 512-token chunk near the end of a
16K-token prompt on the tiny demo took 56-57 ms against 19.5 ms at its start (it attends ~16K
keys), and a short job that arrived during it waited for that (issue 26 measured its p95 wait
over the goal). The long prompt loses little: its attention work per token is the same in small
chunks as in big ones, only each extra forward's fixed cost is added.

The engine's iteration (``Engine._step``) runs the pass first, then the chunks, and admits at
every boundary between forwards: a job that arrives during the pass is admitted when it ends and
runs a pass of its own before the chunks; one that arrives during the chunks joins the next
iteration's pass, which comes right after them. So a short job waits for at most the rest of ONE
forward at the budget (a chunk, or a pass that carries a prompt's last piece) before its first
pass starts, never for a pass and a chunk in a row. Cancellation and deadlines act at the start
of every iteration, i.e. between chunks.

Exactness: a chunk commits exactly the K/V (and, for Clover, the Gated DeltaNet state and conv
ring, carried from chunk to chunk by the recurrent forward) that the fused first pass would
have; block-causal attention makes the later passes' outputs the same (the prefix cache relies
on the same property). Every row's own forwards keep their order (its chunks, then its passes);
only other rows' forwards move between them, and rows share no state. Chunks consume no
randomness, so seeded rows decode the same tokens too.

The rule, per iteration, over the active rows in admission order (oldest first):

* a row feeding at most one block (decoding: the block it just finished) always joins the pass;
* then a prompt row joins if its uncached blocks fit in what the budget has left, oldest first:
  a short prompt goes ahead of the rest of a long prefill (issue 26), whatever their ages;
* the prompt rows left prefill the largest whole-block chunks that fit what is then left
  (``chunk_sizes``); the oldest of them gets at least one block even when the budget is spent,
  so a long prompt always advances. Rows admitted at the boundary after the pass take their
  work from the chunks' in the same way (``Engine._step``).

A shared prefix the prefix cache fills at admission is cut into whole blocks of the budget in
tokens (``chunk_spans`` without a cost): its spans run back to back at admission, so smaller deep
spans would only add forwards; the budget bounds each forward's memory there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.engine.forward_cost import ForwardCost


@dataclass(frozen=True)
class PrefillPlan:
    """Per active row: whether it joins this pass, and the prompt tokens it prefills before;
    ``left``: the budget's work the joining rows leave (the chunks take from it)."""

    joins: list[bool]
    chunks: list[int]
    left: int


def plan_prefill(pending: Sequence[int], contexts: Sequence[int], block_sizes: Sequence[int], budget: int,
                 cost: ForwardCost) -> PrefillPlan:
    """The plan for one iteration (see the module docstring).

    ``pending[i]``: the committed-but-uncached tokens row ``i`` would feed in a pass (its prompt's
    whole blocks before the first pass, one block after each completed block), a multiple of its
    ``block_sizes[i]``; ``contexts[i]``: the positions it has cached. ``budget``: prompt tokens per
    iteration at a prompt's start (``budget_work``); <= 0: chunking off (every row joins, as
    without this module).
    """
    if budget <= 0:
        return PrefillPlan([True] * len(pending), [0] * len(pending), 0)
    joins, left = join_rows(pending, contexts, block_sizes, budget_work(budget, cost), cost)
    rest = [0 if joined else tokens for tokens, joined in zip(pending, joins, strict=True)]
    return PrefillPlan(joins, chunk_sizes(rest, contexts, block_sizes, left, cost), left)


def budget_work(budget: int, cost: ForwardCost) -> int:
    """The work one iteration may spend on prompts: a ``budget``-token prefill at position 0."""
    return cost.work(budget, 0)


def join_rows(pending: Sequence[int], contexts: Sequence[int], block_sizes: Sequence[int], left: int,
              cost: ForwardCost) -> tuple[list[bool], int]:
    """Which rows join a pass out of ``left`` work, and what they leave (negative when the
    one-block rows alone exceed it): every row feeding at most one block (charged at context 0),
    then each prompt that fits what is left at its context, oldest first, each taking its work
    before the next is weighed. The one
    join rule: the plan and the arrivals admitted between forwards (``Engine._step``) use it."""
    joins = [tokens <= block for tokens, block in zip(pending, block_sizes, strict=True)]
    # a decoding row is charged as at a prompt's start: its pass costs what its context makes it
    # (the plan cannot shorten it), and charged at depth a few rows decoding deep into long
    # contexts would spend the whole budget and leave the prompts one block per iteration
    left -= sum(cost.work(tokens, 0) for tokens, joined in zip(pending, joins, strict=True) if joined)
    for i, (tokens, context) in enumerate(zip(pending, contexts, strict=True)):
        if not joins[i] and cost.work(tokens, context) <= left:
            joins[i] = True
            left -= cost.work(tokens, context)
    return joins, left


def chunk_sizes(pending: Sequence[int], contexts: Sequence[int], block_sizes: Sequence[int], left: int,
                cost: ForwardCost) -> list[int]:
    """The whole-block chunk each row prefills out of ``left`` work, oldest first (rows with
    nothing ``pending`` get 0); the first row with something pending gets at least one block."""
    chunks: list[int] = []
    advanced = False  # a prompt row got a chunk this iteration
    for tokens, context, block in zip(pending, contexts, block_sizes, strict=True):
        chunk = 0
        if tokens:
            chunk = min(whole_block_chunk(left, context, block, cost, at_least_one=not advanced), tokens)
        chunks.append(chunk)
        left -= cost.work(chunk, context) if chunk else 0
        advanced = advanced or chunk > 0
    return chunks


def whole_block_chunk(left: int, context: int, block: int, cost: ForwardCost, *, at_least_one: bool) -> int:
    """The largest chunk of whole ``block``-token blocks after ``context`` positions within
    ``left`` work (0 when none fits), or one block when none fits and ``at_least_one`` (a prompt
    must always advance). The one place of the rounding rule: the plan and the prefix fill
    (``chunk_spans``) both cut here."""
    chunk = cost.tokens_within(left, context, block)
    return block if chunk == 0 and at_least_one else chunk


def chunk_spans(start: int, end: int, block: int, budget: int,
                cost: ForwardCost | None) -> list[tuple[int, int]]:
    """``[start, end)`` (whole blocks of a prompt) cut into the ``(from, to)`` spans that prefill it
    under ``budget``: whole blocks, at least one per span; as the plan counts it (prompt tokens'
    work at a prompt's start, fewer tokens as the context grows) with a ``cost``, in plain
    ``budget``-token spans without one; one span when chunking is off (``budget`` <= 0). Empty
    when there is nothing to fill."""
    if budget <= 0:
        return [(start, end)] if end > start else []
    if cost is None:
        step = max(budget // block, 1) * block
        return [(at, min(at + step, end)) for at in range(start, end, step)]
    work, spans, at = budget_work(budget, cost), [], start
    while at < end:
        to = min(at + whole_block_chunk(work, at, block, cost, at_least_one=True), end)
        spans.append((at, to))
        at = to
    return spans
