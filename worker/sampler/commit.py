"""Which masked positions a denoising pass commits (static / dynamic rules of the contract).

Batched over rows with per-row quota, threshold and strategy. Ties in confidence go to the
lower position: a stable descending sort keeps equal values in position order.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rank_by_confidence(confidence: Tensor, masked: Tensor) -> Tensor:
    """Rank of each masked position among its row's masked positions (0 = most confident).

    confidence: [R, T]; masked: [R, T] bool. Unmasked positions rank after every masked one.
    """
    keyed = confidence.masked_fill(~masked, float("-inf"))  # [R, T]
    order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices  # [R, T]
    positions = torch.arange(confidence.shape[-1], device=confidence.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, positions)  # [R, T]


def choose_commits(
    confidence: Tensor, masked: Tensor, quota: Tensor, threshold: Tensor, dynamic: Tensor
) -> Tensor:
    """Positions to commit this pass.

    confidence: [R, T] float; masked: [R, T] bool (still-masked positions of the current block);
    quota: [R] long (this step's k, already capped at the masks left); threshold: [R] float;
    dynamic: [R] bool. Static commits the ``quota`` most confident masks; dynamic commits every
    mask strictly above the threshold when there are at least ``quota`` of them, otherwise falls
    back to the static choice. Returns [R, T] bool.
    """
    top = (rank_by_confidence(confidence, masked) < quota[:, None]) & masked  # [R, T]
    above = masked & (confidence > threshold[:, None])  # [R, T]
    use_above = dynamic & (above.sum(dim=-1) >= quota)  # [R]
    return torch.where(use_above[:, None], above, top)


def expand_to_groups(chosen: Tensor, group_ids: Tensor, num_groups: int) -> Tensor:
    """Commit whole groups: if any position of a group is chosen, choose all of its positions.

    chosen: [R, T] bool; group_ids: [R, T] long, -1 for positions in no group, else < num_groups.
    Used for restricted infill slots, which are committed as one unit.
    """
    if num_groups == 0:
        return chosen
    in_group = group_ids >= 0  # [R, T]
    index = group_ids.clamp(min=0)  # [R, T]
    hit = torch.zeros(chosen.shape[0], num_groups, dtype=torch.bool, device=chosen.device)
    hit = hit.scatter_reduce(-1, index, chosen & in_group, reduce="amax")  # [R, G]
    return chosen | (hit.gather(-1, index) & in_group)
