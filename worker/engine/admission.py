"""Admission policy: which waiting requests may join the running batch (bookkeeping only).

First come, first served, with three limits: the batch size (KV-cache slots), the KV positions
held at once (memory), and per-class caps so one class of long work (e.g. joint decisions)
cannot take every slot. A request blocked only by its class cap is skipped so others can go; a
request blocked by memory stops the scan so that big requests are not starved by small ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """What admission needs to know about one waiting request."""

    slot_class: str
    positions: int  # KV positions it will hold at most (prompt + generated region)


@dataclass(frozen=True)
class Occupancy:
    """What is running now."""

    active: int
    positions: int
    per_class: Mapping[str, int]


def pick_admissions(
    waiting: Sequence[Candidate],
    occupancy: Occupancy,
    *,
    max_batch: int,
    max_positions: int,
    slot_caps: Mapping[str, int],
) -> list[int]:
    """Indexes (in queue order) of the waiting requests to admit now."""
    admitted: list[int] = []
    active = occupancy.active
    positions = occupancy.positions
    per_class = dict(occupancy.per_class)
    for index, cand in enumerate(waiting):
        if active >= max_batch:
            break
        cap = slot_caps.get(cand.slot_class)
        if cap is not None and per_class.get(cand.slot_class, 0) >= cap:
            continue
        if positions + cand.positions > max_positions:
            break
        admitted.append(index)
        active += 1
        positions += cand.positions
        per_class[cand.slot_class] = per_class.get(cand.slot_class, 0) + 1
    return admitted
