"""bench.api --tracing's block order: over as many rounds as setups, each setup takes each place once
(a trend over the run then lands on every setup alike)."""

from __future__ import annotations

from bench.api import TRACING_SETUPS, rotated


def test_each_setup_takes_each_place_once_over_a_full_rotation() -> None:
    setups = list(TRACING_SETUPS)
    orders = [rotated(setups, round_) for round_ in range(len(setups))]
    for order in orders:
        assert sorted(order) == sorted(setups)  # every block runs once per round
    for place in range(len(setups)):
        assert sorted(order[place] for order in orders) == sorted(setups)
    assert rotated(setups, len(setups)) == setups
    assert rotated([], 3) == []
