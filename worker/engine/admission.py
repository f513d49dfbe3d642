"""Admission policy: which waiting requests may join the running batch (bookkeeping only).

First come, first served, with four limits: the batch size (KV-cache slots), the KV positions
held at once (memory), per-class caps so one class of long work (e.g. joint decisions) cannot
take every slot, and a share of slots only the reserved classes (interactive) may take, so that
bulk or standard work filling the batch never makes a short request wait for a slot. A request
blocked only by a class cap or the reserve is skipped so others can go; a request blocked by
memory stops the scan so that big requests are not starved by small ones.
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
    reserved: int = 0,
    reserved_classes: frozenset[str] = frozenset(),
) -> list[int]:
    """Indexes (in queue order) of the waiting requests to admit now.

    ``max_batch`` counts every slot, the ``reserved`` ones included: requests outside
    ``reserved_classes`` may hold at most ``max_batch - reserved`` of them together.
    """
    admitted: list[int] = []
    active = occupancy.active
    positions = occupancy.positions
    per_class = dict(occupancy.per_class)
    unreserved = sum(n for c, n in per_class.items() if c not in reserved_classes)
    for index, cand in enumerate(waiting):
        if active >= max_batch:
            break
        cap = slot_caps.get(cand.slot_class)
        if cap is not None and per_class.get(cand.slot_class, 0) >= cap:
            continue
        open_to_all = cand.slot_class in reserved_classes
        if not open_to_all and unreserved >= max_batch - reserved:
            continue
        if positions + cand.positions > max_positions:
            break
        admitted.append(index)
        active += 1
        unreserved += 0 if open_to_all else 1
        positions += cand.positions
        per_class[cand.slot_class] = per_class.get(cand.slot_class, 0) + 1
    return admitted
