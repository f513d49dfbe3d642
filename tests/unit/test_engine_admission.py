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
