"""Admission policy (pure bookkeeping): batch size, KV positions, per-class caps, FIFO."""

from __future__ import annotations

from worker.engine.admission import Candidate, Occupancy, pick_admissions

IDLE = Occupancy(active=0, positions=0, per_class={})


def test_fifo_up_to_the_batch_size() -> None:
    waiting = [Candidate("standard", 10)] * 5
    assert pick_admissions(waiting, IDLE, max_batch=3, max_positions=1000, slot_caps={}) == [0, 1, 2]
    busy = Occupancy(active=2, positions=20, per_class={"standard": 2})
    assert pick_admissions(waiting, busy, max_batch=3, max_positions=1000, slot_caps={}) == [0]


def test_class_cap_skips_only_that_class() -> None:
    waiting = [Candidate("joint", 10), Candidate("joint", 10), Candidate("standard", 10)]
    busy = Occupancy(active=1, positions=10, per_class={"joint": 1})
    assert pick_admissions(waiting, busy, max_batch=8, max_positions=1000, slot_caps={"joint": 1}) == [2]
    assert pick_admissions(waiting, IDLE, max_batch=8, max_positions=1000, slot_caps={"joint": 1}) == [0, 2]


def test_memory_limit_stops_the_scan_so_big_requests_are_not_starved() -> None:
    waiting = [Candidate("standard", 60), Candidate("standard", 50), Candidate("standard", 5)]
    busy = Occupancy(active=1, positions=50, per_class={"standard": 1})
    assert pick_admissions(waiting, busy, max_batch=8, max_positions=100, slot_caps={}) == []
    assert pick_admissions(waiting, IDLE, max_batch=8, max_positions=100, slot_caps={}) == [0]


def test_reserved_slots_are_only_for_the_reserved_classes() -> None:
    """Bulk fills the unreserved slots; the reserve stays open to interactive work."""
    reserve = {"reserved": 2, "reserved_classes": frozenset({"interactive"})}
    bulk = [Candidate("bulk", 10)] * 6
    full = pick_admissions(bulk, IDLE, max_batch=6, max_positions=1000, slot_caps={}, **reserve)
    assert full == [0, 1, 2, 3]  # 6 slots, 2 of them reserved
    busy = Occupancy(active=4, positions=40, per_class={"bulk": 4})
    mixed = [Candidate("bulk", 10), Candidate("interactive", 10), Candidate("interactive", 10)]
    assert pick_admissions(mixed, busy, max_batch=6, max_positions=1000, slot_caps={}, **reserve) == [1, 2]
    # interactive may use every slot, the unreserved ones too
    short = [Candidate("interactive", 10)] * 7
    assert pick_admissions(short, IDLE, max_batch=6, max_positions=1000, slot_caps={}, **reserve) == list(
        range(6)
    )
