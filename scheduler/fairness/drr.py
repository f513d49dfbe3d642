"""Deficit round robin over flows, weighted per tenant: the order in which held jobs are released.

Why DRR (Shreedhar and Varghese, 1996): it shares by *cost*, not by job count, in O(1) per job,
and its state is a few numbers per flow that survive being stored between calls made by different
processes. A **flow** is one tenant's batch, or that tenant's single jobs (``<tenant>/<batch id>``,
``<tenant>/-``). Each visit of a backlogged flow adds its quantum to its deficit; the flow releases
jobs while its next job's cost (``Job.cost``, the router's estimate of engine work) fits in the
deficit, then the turn passes on. A flow that empties forgets its deficit (no credit for idling).

Weights: a tenant's quantum is its weight (default 1, ``scheduler/fairness/weights.py``) split
evenly among its backlogged flows, so tenants share a class in proportion to their weights
whatever their batch counts, and a tenant's batches share its part equally.

Quantum size: one cost unit per unit of weight. Rounds in which no flow could release are skipped
at once (every deficit advances by the same number of quanta), so the result is the DRR order of
an arbitrarily small quantum: jobs interleave one by one instead of in bursts, at O(flows) per pick.

The policy is pure: :class:`DeficitRoundRobin` reads the flows' next costs through :class:`Heads`
and mutates only its :class:`DrrState`. ``scheduler/fairness/release.py`` stores the state in Redis
between passes; ``tests/unit/test_fairness_drr.py`` holds it equal to the textbook loop.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

LOOSE_JOBS = "-"  # the batch part of the flow of a tenant's single (non-batch) jobs
_EPSILON = 1e-9
_MAX_CYCLES = 64  # per pick; a skip makes some flow affordable within one cycle (floats: a few)


def flow_id(tenant: str, batch_id: uuid.UUID | str | None) -> str:
    """The flow of a job: its tenant and batch (tenant names never hold ``/``)."""
    return f"{tenant}/{batch_id if batch_id is not None else LOOSE_JOBS}"


def tenant_of(flow: str) -> str:
    return flow.rsplit("/", 1)[0]


class Heads(Protocol):
    """The flows' held jobs as the policy sees them (the caller takes the job a pick names)."""

    def peek(self, flow: str) -> int | None:
        """Cost of the flow's next job; None when the flow holds none."""


@dataclass
class DrrState:
    """Backlogged flows in round-robin order (``order[0]`` is being visited), their deficits,
    and whether ``order[0]`` already got its quantum for this visit."""

    order: list[str] = field(default_factory=list)
    deficit: dict[str, float] = field(default_factory=dict)
    visiting: bool = False

    def to_json(self) -> str:
        return json.dumps({"order": self.order, "deficit": self.deficit, "visiting": self.visiting},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes | None) -> DrrState:
        """The stored state; a missing or unreadable one starts afresh (equal deficits: fair)."""
        if not raw:
            return cls()
        try:
            data = json.loads(raw)
            order = [str(flow) for flow in data["order"]]
            deficit = {str(flow): float(value) for flow, value in data["deficit"].items()}
            return cls(order=order, deficit=deficit, visiting=bool(data["visiting"]) and bool(order))
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls()


def quanta(flows: Iterable[str], weight: Callable[[str], float]) -> dict[str, float]:
    """Each flow's quantum: its tenant's weight split evenly among the tenant's flows in ``flows``."""
    listed = list(flows)
    per_tenant: dict[str, int] = {}
    for flow in listed:
        per_tenant[tenant_of(flow)] = per_tenant.get(tenant_of(flow), 0) + 1
    return {flow: weight(tenant_of(flow)) / per_tenant[tenant_of(flow)] for flow in listed}


class DeficitRoundRobin:
    """Weighted DRR over ``state`` (see the module docstring). ``weight``: a tenant's weight (> 0)."""

    def __init__(self, state: DrrState, weight: Callable[[str], float]) -> None:
        self.state = state
        self._weight = weight

    def sync(self, backlogged: Iterable[str]) -> None:
        """Make the round robin's flows exactly ``backlogged``: flows gone forget their deficit,
        new ones join at the end of the round with none (in name order, so replays agree)."""
        wanted = set(backlogged)
        state = self.state
        if state.order and state.order[0] not in wanted:
            state.visiting = False
        state.order = [flow for flow in state.order if flow in wanted]
        known = set(state.order)
        state.order += sorted(wanted - known)
        state.deficit = {flow: state.deficit.get(flow, 0.0) for flow in state.order}

    def pick(self, heads: Heads) -> str | None:
        """The flow whose next job is released now (its deficit is charged; the caller takes
        that job out of ``heads``), or None when no flow holds a job."""
        state = self.state
        for _ in range(_MAX_CYCLES):
            if not self._drop_empty_head(heads):
                return None
            q = quanta(state.order, self._weight)
            for _ in range(len(state.order)):
                flow = state.order[0]
                cost = heads.peek(flow)
                if cost is None:  # emptied since (a cancel): leave the round
                    self._drop_empty_head(heads)
                    break
                if not state.visiting:
                    state.deficit[flow] += q[flow]
                    state.visiting = True
                if cost <= state.deficit[flow] + _EPSILON * max(1.0, cost):
                    state.deficit[flow] -= cost
                    return flow
                state.order.append(state.order.pop(0))  # its turn ends; the next flow's begins
                state.visiting = False
            else:  # a whole cycle released nothing: skip the rounds that would release nothing
                self._skip_idle_rounds(heads, q)
        return state.order[0] if state.order else None  # unreachable in practice: floats gone wrong

    def _drop_empty_head(self, heads: Heads) -> bool:
        """Remove flows holding nothing from the front (and anywhere); False when none is left."""
        state = self.state
        emptied = [flow for flow in state.order if heads.peek(flow) is None]
        if emptied:
            if state.order[0] in emptied:
                state.visiting = False
            state.order = [flow for flow in state.order if flow not in set(emptied)]
            for flow in emptied:
                state.deficit.pop(flow, None)
        return bool(state.order)

    def _skip_idle_rounds(self, heads: Heads, q: dict[str, float]) -> None:
        """After a cycle in which no flow could release: add the quanta of every further cycle in
        which none could either (the first cycle some flow can afford its next job is played)."""
        state = self.state
        rounds = []
        for flow in state.order:
            cost = heads.peek(flow)
            assert cost is not None
            rounds.append(math.ceil((cost - state.deficit[flow]) / q[flow] - _EPSILON))
        skip = max(0, min(rounds) - 1)
        if skip:
            for flow in state.order:
                state.deficit[flow] += skip * q[flow]
