"""What one forward costs, in attention-key equivalents, and the engine's own measure of it.

A forward of ``T`` tokens over ``S = context + T`` keys costs about ``T * (S + W)``: attention
grows with the keys, everything else (projections, experts, the GDN recurrence, per-token host
work) with the tokens alone; ``W`` is that per-token rest counted as attention keys. Two places
need it: the pass grouping (``pass_groups.split_pass``: does one heavy row make the others pay?)
and chunked prefill (``prefill_chunks``: how many prompt tokens a chunk may carry at a given depth
so that every chunk costs the budget's forward, issue 26).

``W`` depends on the checkpoint and the hardware, not only the config: on the tiny CPU demo the
small matmuls run far less efficiently than the flash attention kernel, so FLOP counting gives
~800 where timing gives ~3,100 (measured: 3.8 ms per forward, 17 us per token, 5.5 ns per token
and key); on the real model on a GPU the experts and the host dominate and ``W`` is tens of
thousands. So the engine measures it once, before its first prefill chunk (``Engine.calibrate``):
single-row prefill forwards at two sizes and two depths, five times each, fitted by least squares
on ``seconds ~= f + a * T + c * T * S`` (:func:`fit_token_keys`), ``W = a / c``; the intercept ``f``
is a forward's fixed cost (3.8 ms on the tiny demo, as much as 220 tokens' per-token work), which
would otherwise inflate ``W``. A designed set of forwards, not the engine's own chunks: those are
cut by the current ``W`` (``T * (S + W)`` constant), so fitted on them the figure confirms
itself (a simulated host-bound GPU shape with W = 40,000 and 15% timing noise settled near
4,000). The operator can fix ``W`` instead (``CLOVERQ_ENGINE_TOKEN_WORK_KEYS``); without chunking,
or with a cache too short to reach a useful depth, ``DEFAULT_TOKEN_WORK_KEYS``.
Grouping and chunk sizes change no token (rows share no state; chunks commit exactly what a fused
prefill would), so a measured ``W`` only moves *when* work runs, never what it computes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# before any measurement: between the tiny demo's figure with and without the forward's fixed cost
# separated (~3,100 and ~4,400); far below the real model's, which only makes its chunks smaller
DEFAULT_TOKEN_WORK_KEYS = 4096
# a measured W is kept inside these bounds: below a quarter of the default, deep chunks would
# shrink to single blocks that each pay a forward's fixed cost; the top is beyond any real model
_LEAST_KEYS, _MOST_KEYS = DEFAULT_TOKEN_WORK_KEYS // 4, 1 << 20
# timed forwards per size and depth in the runner's calibration (fit_token_keys says why five)
CALIBRATION_REPEATS = 5


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
        b = context + self.token_keys  # t * (t + b) <= work: the positive root of t^2 + b t - work,
        t = (math.isqrt(b * b + 4 * work) - b) // 2  # floored exactly (b is an integer)
        return t // block * block


def fit_token_keys(samples: Sequence[tuple[int, int, float]]) -> int | None:
    """``W = a / c`` from ``(tokens, context, seconds)`` forwards by least squares on
    ``seconds ~= f + a * T + c * T * (context + T)`` (module docstring), clamped to the bounds.
    Where timing noise hides attention's share (``c`` under five standard errors: a host-bound
    GPU at the calibration's depth), the top bound: chunks do not shrink, as with a budget in
    tokens. That errs the safe way: up to that depth a deep chunk cost what a first one did
    (within the noise), while smaller chunks would multiply forwards that each pay the fixed
    cost (~100 ms on an H200, docs/gpu-h200.md). Why five errors and five repeats: on a simulated
    GPU shape with 2% timing noise (300 seeded calibrations), three and three put 16% of the
    figures under two thirds of the true W, five and five 2%. None when the samples cannot tell
    (fewer than five, collinear, or ``a`` not positive)."""
    if len(samples) < 5:
        return None
    x = np.array([[1.0, t, t * (s + t)] for t, s, _ in samples])  # [N, 3]
    y = np.array([seconds for _, _, seconds in samples])  # [N]
    scale = np.linalg.norm(x, axis=0)  # columns of unit length: the condition says collinearity
    if np.any(scale == 0) or np.linalg.cond(x / scale) > 1e6:
        return None
    xs = x / scale
    coef = np.linalg.lstsq(xs, y, rcond=None)[0]
    residual = y - xs @ coef
    variance = float(residual @ residual) / (len(samples) - 3)
    c_error = math.sqrt(variance * float(np.linalg.inv(xs.T @ xs)[2, 2])) / scale[2]
    a, c = float(coef[1] / scale[1]), float(coef[2] / scale[2])  # seconds per token; per token and key
    if a <= 0:
        return None
    if c <= 5 * c_error:
        return _MOST_KEYS
    return int(min(max(a / c, _LEAST_KEYS), _MOST_KEYS))
