"""Certainty forcing: a loss term that makes the model sure where it is already right.

``dynamic`` decoding commits a block's positions whose confidence is above the threshold (0.9 in
issue 25's bar), at least one per pass. The shipped demo's argmax on a block's first pass is right
more often than it is sure (``python -m bench.tpp_bound``: 376 of 448 positions right, 326 sure),
so it spends passes on positions it would have got right anyway. dParallel (Chen et al., 2025,
"Learnable Parallel Decoding for dLLMs") adds to the cross-entropy the entropy of the
temperature-scaled prediction at the masked targets whose argmax is already the true token: the
gradient sharpens predictions that are right and leaves wrong ones to the cross-entropy alone, so
the model is not pushed to be sure of a mistake. A plain-torch term here, computed on the same
logits as the cross-entropy (no extra pass).

Only targets of rows without choice slots (generation, tool-call and self-distillation rows) get
the term: a decision row's slot is scored whole against its choices, never committed by a
confidence threshold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.training.rows import Row

# the softmax temperature of the entropy (dParallel's choice, 0.5): below 1 the gradient is
# concentrated on right predictions with a small margin over the runner-up (for a margin m it is
# about m / T^2 * exp(-m / T)), the ones a threshold of 0.9 does not yet commit
CERTAINTY_TEMPERATURE = 0.5


def certainty_term(logits: torch.Tensor, gold: torch.Tensor) -> torch.Tensor:
    """``[..., K]``: the entropy (nats) of ``softmax(logits / CERTAINTY_TEMPERATURE)`` at each
    target whose argmax is ``gold``, 0 at the others. ``logits`` ``[..., K, V]``, ``gold``
    ``[..., K]``. The right/wrong mask carries no gradient."""
    logp = F.log_softmax(logits / CERTAINTY_TEMPERATURE, dim=-1)  # [..., K, V]
    entropy = -(logp.exp() * logp).sum(dim=-1)  # [..., K]
    right = logits.argmax(dim=-1) == gold  # [..., K]
    return entropy * right


def certainty_weights(rows: list[Row], weight: float, width: int) -> torch.Tensor:
    """``[B, width]``: ``weight`` at every position of a row without choice slots, 0 for decision
    rows (whose slots are scored, not committed by confidence). Multiplied by the targets' masks
    where it is used, as ``trainer.target_weights`` is."""
    per_row = torch.tensor([0.0 if row.units else weight for row in rows])  # [B]
    return per_row[:, None].expand(len(rows), width).clone()
