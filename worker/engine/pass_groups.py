"""Which rows of a denoising pass share a forward: a pass is one forward, or two when padding
its rows together would waste more than half of the work.

The runner pads a forward's rows to its longest row (``T`` tokens) and, with more than one row,
attends every row over the longest committed context plus ``T`` (``S`` keys, the dense mask of
``worker/model/mask.py``). One row that feeds a prompt's last piece (hundreds of tokens) pads
every short row to it; one row that decodes after a 16K-token prompt makes every short row attend
over 16K masked keys (measured on the tiny demo: a 12-row pass with one such row took longer
than a 512-token prefill chunk). Either way the short rows pay for it, and a short job that
arrives meanwhile waits for it (issue 26).

The estimate of a forward's work, in key-equivalents: ``R * T * (S + W)``, where ``W`` is one
token's work outside attention (projections, experts) counted as attention keys
(``forward_cost.py``: measured by the engine before its first prefill chunk). The rows are
cut in two at the threshold, over either the tokens or the context of a row, that minimises the
estimate; the cut is taken only if it at least halves it (a second forward has a fixed cost the
estimate leaves out). The light group runs first, so a short row's pass never waits for a heavy
row's forward. Rows share no state, so the grouping changes no row's result.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.engine.forward_cost import ForwardCost


def forward_work(tokens: Sequence[int], contexts: Sequence[int], rows: Sequence[int],
                 cost: ForwardCost = ForwardCost()) -> int:
    """The estimated work of one forward over ``rows``: ``R * T * (S + W)`` (module docstring),
    every row padded to the longest one's tokens over the longest context."""
    if not rows:
        return 0
    return len(rows) * cost.work(max(tokens[i] for i in rows), max(contexts[i] for i in rows))


def split_pass(tokens: Sequence[int], contexts: Sequence[int],
               cost: ForwardCost = ForwardCost()) -> list[list[int]]:
    """Row indices per forward, in the order to run them (light rows first).

    ``tokens[i]``: the tokens row ``i`` feeds; ``contexts[i]``: its committed positions before the
    pass (what it attends over besides its own tokens). Linear in the rows after one sort per
    dimension (it runs every pass): the maxima of each side come from running maxima."""
    r = len(tokens)
    everyone = list(range(r))
    together = forward_work(tokens, contexts, everyone, cost)
    best: tuple[int, list[int], int] | None = None  # (work, the ordering, the cut k)
    for size in (tokens, contexts):
        order = sorted(everyone, key=lambda i: size[i])
        heavy_t, heavy_s = [0] * (r + 1), [0] * (r + 1)  # maxima over order[k:]
        for k in range(r - 1, -1, -1):
            heavy_t[k] = max(heavy_t[k + 1], tokens[order[k]])
            heavy_s[k] = max(heavy_s[k + 1], contexts[order[k]])
        light_t = light_s = 0
        for k in range(1, r):  # order[:k] light, order[k:] heavy
            light_t, light_s = max(light_t, tokens[order[k - 1]]), max(light_s, contexts[order[k - 1]])
            if size[order[k - 1]] == size[order[k]]:
                continue  # a cut between equal sizes is no threshold
            work = k * cost.work(light_t, light_s) + (r - k) * cost.work(heavy_t[k], heavy_s[k])
            if best is None or work < best[0]:
                best = (work, order, k)
    if best is None or 2 * best[0] >= together:
        return [everyone]
    _, order, k = best  # the two groups are built once, for the cut that won
    return [sorted(order[:k]), sorted(order[k:])]
