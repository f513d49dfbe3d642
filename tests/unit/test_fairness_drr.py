"""The fair-share release policy (scheduler/fairness/drr.py) against the textbook DRR loop.

The policy picks one job at a time, its state stored as JSON between picks (as the release
passes of different processes store it in Redis) and rounds that release nothing skipped at
once. The reference below is the plain loop of Shreedhar and Varghese, every round played, with
the same weighting (a tenant's weight split among its backlogged flows): both must release the
same flows in the same order.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Callable

import pytest

from scheduler.fairness.drr import DeficitRoundRobin, DrrState, flow_id, quanta, tenant_of


class ListHeads:
    """Held jobs as plain lists of costs per flow."""

    def __init__(self, backlog: dict[str, list[int]]) -> None:
        self.queues = {flow: deque(costs) for flow, costs in backlog.items() if costs}

    def peek(self, flow: str) -> int | None:
        queue = self.queues.get(flow)
        return queue[0] if queue else None

    def take(self, flow: str) -> int:
        return self.queues[flow].popleft()

    @property
    def flows(self) -> list[str]:
        return [flow for flow, queue in self.queues.items() if queue]


def textbook_drr(backlog: dict[str, list[int]], weight: Callable[[str], float]) -> list[str]:
    """Plain DRR: visit the flows in turn, add the quantum, send while the head fits."""
    queues = {flow: deque(costs) for flow, costs in backlog.items() if costs}
    order = sorted(queues)
    deficit = dict.fromkeys(order, 0.0)
    sent: list[str] = []
    while order:
        flow = order[0]
        deficit[flow] += quanta(order, weight)[flow]
        while queues[flow] and queues[flow][0] <= deficit[flow] + 1e-9 * max(1, queues[flow][0]):
            deficit[flow] -= queues[flow].popleft()
            sent.append(flow)
        if queues[flow]:
            order.append(order.pop(0))
        else:
            order.pop(0)
            del deficit[flow]
    return sent


def policy_order(backlog: dict[str, list[int]], weight: Callable[[str], float]) -> list[str]:
    """The policy, one pick per call, its state round-tripped through JSON in between."""
    heads = ListHeads(backlog)
    stored = DrrState().to_json()
    sent: list[str] = []
    while True:
        policy = DeficitRoundRobin(DrrState.from_json(stored), weight)
        policy.sync(heads.flows)
        flow = policy.pick(heads)
        if flow is None:
            return sent
        heads.take(flow)
        sent.append(flow)
        stored = policy.state.to_json()


def random_backlog(rng: random.Random) -> tuple[dict[str, list[int]], dict[str, float]]:
    tenants = [f"t{i}" for i in range(rng.randint(1, 4))]
    backlog: dict[str, list[int]] = {}
    for tenant in tenants:
        for batch in range(rng.randint(1, 3)):
            flow = flow_id(tenant, f"b{batch}" if batch else None)
            backlog[flow] = [rng.choice((1, 3, 16, 40, 100)) for _ in range(rng.randint(1, 12))]
    weights = {tenant: rng.choice((0.5, 1.0, 2.0, 3.0)) for tenant in tenants}
    return backlog, weights


@pytest.mark.parametrize("seed", range(40))
def test_the_policy_releases_in_the_textbook_order(seed: int) -> None:
    backlog, weights = random_backlog(random.Random(seed))
    weight = weights.__getitem__
    assert policy_order(backlog, weight) == textbook_drr(backlog, weight)


def test_weights_three_to_one_share_every_window_three_to_one() -> None:
    backlog = {flow_id("a", "batch"): [32] * 400, flow_id("b", "batch"): [32] * 400}
    order = policy_order(backlog, {"a": 3.0, "b": 1.0}.__getitem__)
    for start in range(0, 400, 40):  # both backlogged throughout these windows
        counts = Counter(tenant_of(flow) for flow in order[start:start + 40])
        assert abs(counts["a"] - 30) <= 1 and abs(counts["b"] - 10) <= 1, (start, counts)


def test_tenants_share_by_weight_and_a_tenants_batches_share_its_part() -> None:
    backlog = {flow_id("a", "b1"): [10] * 200, flow_id("a", "b2"): [10] * 200, flow_id("b", None): [10] * 200}
    first = Counter(policy_order(backlog, lambda _: 1.0)[:200])
    assert first[flow_id("b", None)] == pytest.approx(100, abs=2)
    assert first[flow_id("a", "b1")] == pytest.approx(50, abs=2)
    assert first[flow_id("a", "b2")] == pytest.approx(50, abs=2)


def test_capacity_is_shared_by_cost_not_by_job_count() -> None:
    backlog = {flow_id("cheap", None): [10] * 300, flow_id("dear", None): [30] * 100}
    order = policy_order(backlog, lambda _: 1.0)[:120]
    cost: Counter[str] = Counter()
    for flow in order:
        cost[tenant_of(flow)] += 10 if tenant_of(flow) == "cheap" else 30
    assert cost["cheap"] == pytest.approx(cost["dear"], abs=30)


def test_a_flow_that_joins_a_long_backlog_is_served_within_one_round() -> None:
    heads = ListHeads({flow_id("a", "big"): [16] * 1000})
    policy = DeficitRoundRobin(DrrState(), lambda _: 1.0)
    for _ in range(50):
        policy.sync(heads.flows)
        heads.take(policy.pick(heads) or "")
    heads.queues[flow_id("b", None)] = deque([16] * 5)
    served = []
    for _ in range(4):
        policy.sync(heads.flows)
        flow = policy.pick(heads)
        assert flow is not None
        heads.take(flow)
        served.append(tenant_of(flow))
    assert served.count("b") >= 2  # alternating from the newcomer's first round on


def test_flows_gone_from_the_backlog_forget_their_deficit() -> None:
    state = DrrState(order=["a/-", "b/-"], deficit={"a/-": 5.0, "b/-": 7.0}, visiting=True)
    policy = DeficitRoundRobin(state, lambda _: 1.0)
    policy.sync(["b/-", "c/-"])
    assert state.order == ["b/-", "c/-"] and state.deficit == {"b/-": 7.0, "c/-": 0.0}
    assert state.visiting is False  # the flow being visited left: the next visit starts afresh


def test_a_garbled_stored_state_starts_afresh() -> None:
    assert DrrState.from_json(b"not json") == DrrState()
    assert DrrState.from_json(None) == DrrState()
    assert DrrState.from_json('{"order": ["a/-"], "deficit": {"a/-": "x"}, "visiting": true}') == DrrState()
