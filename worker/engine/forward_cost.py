"""What one forward costs, in attention-key equivalents, and the engine's own measure of it.

A forward of ``T`` tokens over ``S = context + T`` keys costs about ``T * (S + W)``: attention
grows with the keys, everything else (projections, experts, the GDN recurrence, per-token host
work) with the tokens alone; ``W`` is that per-token rest counted as attention keys. Two places
need it: the pass grouping (``pass_groups.split_pass``: does one heavy row make the others pay?)
and chunked prefill (``prefill_chunks``: how many prompt tokens a chunk may carry at a given depth
so that every chunk costs the budget's forward, issue 26).

``W`` depends on the checkpoint and the hardware, not only the config: on the tiny CPU demo the
small matmuls run ~10x less efficiently than the flash attention kernel, so FLOP counting gives
~800 where timing gives ~6,600; on the real model on a GPU the experts dominate and ``W`` is tens
of thousands. So the runner measures it from its own prefill forwards (``TokenWorkFit``: one row,
no padding, so ``T`` and ``S`` are exact), unless the operator fixes it
(``CLOVERQ_ENGINE_TOKEN_WORK_KEYS``). Until enough forwards were seen, ``DEFAULT_TOKEN_WORK_KEYS``.
Grouping and chunk sizes change no token (rows share no state; chunks commit exactly what a fused
prefill would), so a measured ``W`` only moves *when* work runs, never what it computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# before any measurement: the order of the tiny demo's measured figure (about 6,600 on 2 CPU
# cores: a 512-token chunk took 19.5 ms at context 512 and 57.6 ms at context 15,360)
DEFAULT_TOKEN_WORK_KEYS = 4096
# a measured W is kept inside these bounds (a fit over near-identical forwards can be wild)
_LEAST_KEYS, _MOST_KEYS = 64, 1 << 20


@dataclass(frozen=True)
class ForwardCost:
    """The cost model ``T * (S + W)`` with ``W = token_keys`` (module docstring)."""

    token_keys: int = DEFAULT_TOKEN_WORK_KEYS

    def work(self, tokens: int, context: int) -> int:
        """One row feeding ``tokens`` after ``context`` committed positions."""
        return tokens * (context + tokens + self.token_keys)

    def tokens_within(self, work: int, context: int, block: int) -> int:
        """The most whole ``block``-token blocks one row may feed after ``context`` positions
        within ``work`` (0 when not even one block fits)."""
        if work <= 0:
            return 0
        b = context + self.token_keys  # t * (t + b) <= work: the positive root of t^2 + b t - work
        t = (math.isqrt(b * b + 4 * work) - b) // 2
        while t > 0 and self.work(t, context) > work:  # isqrt's floor can overshoot by one
            t -= 1
        return t // block * block


class TokenWorkFit:
    """``W`` from timed single-row forwards by least squares on ``seconds ~= f + a * T + c * T * S``,
    ``W = a / c``. The intercept ``f`` is a forward's fixed cost (on the tiny CPU demo about 3.8 ms,
    as much as 300 tokens' per-token work): left in ``a`` it would inflate ``W`` by ``f / (c T)``.
    It is the same for every forward, so it does not enter the chunk sizes, only the fit; while
    the forwards seen all had one size (fixed chunks), ``f`` cannot be told from ``a`` and the fit
    drops it (``f`` folded into ``a``: ``W`` errs high, i.e. towards larger deep chunks).

    Observations decay so that the figure follows the machine (another process, a clock change);
    the first ``warmup`` forwards are not counted (a cold first forward costs several warm ones:
    allocation, kernel selection), and the fit is only trusted once it has seen forwards at
    contexts that differ by at least ``spread`` keys."""

    def __init__(self, *, decay: float = 0.98, least_seen: int = 6, spread: int = 1024,
                 warmup: int = 2) -> None:
        self._decay, self._least_seen, self._spread = decay, least_seen, spread
        self._skip = warmup
        self._xx = np.zeros((3, 3))  # decayed normal equations over the features (1, T, T * S)
        self._xy = np.zeros(3)
        self._seen = 0
        self._low: int | None = None  # the least and the most keys seen
        self._high: int | None = None

    def observe(self, tokens: int, context: int, seconds: float) -> None:
        """One forward of ``tokens`` after ``context`` positions that took ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        if self._skip > 0:
            self._skip -= 1
            return
        keys = context + tokens
        x = np.array([1.0, tokens, tokens * keys])
        self._xx = self._decay * self._xx + np.outer(x, x)
        self._xy = self._decay * self._xy + x * seconds
        self._seen += 1
        self._low = keys if self._low is None else min(self._low, keys)
        self._high = keys if self._high is None else max(self._high, keys)

    def token_keys(self) -> int | None:
        """The measured ``W``, or None while the forwards seen cannot tell it."""
        if self._seen < self._least_seen or self._low is None or self._high is None:
            return None
        if self._high - self._low < self._spread:
            return None
        for features in ([0, 1, 2], [1, 2]):  # with the fixed cost, else without it
            xx = self._xx[np.ix_(features, features)]
            scale = np.sqrt(np.diag(xx))
            if np.any(scale == 0):
                continue
            normed = xx / np.outer(scale, scale)  # unit diagonal: the condition says collinearity
            if np.linalg.cond(normed) > 1e8:
                continue
            coef = np.linalg.solve(normed, self._xy[features] / scale) / scale
            a, c = coef[-2], coef[-1]  # seconds per token, per token and key
            if a > 0 and c > 0:
                return int(min(max(a / c, _LEAST_KEYS), _MOST_KEYS))
        return None
