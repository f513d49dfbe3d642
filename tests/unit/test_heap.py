"""scheduler.infra.gc_freeze: start-up objects leave the cyclic collector's working set."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from scheduler.infra.gc_freeze import freeze_startup_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # later tests of this process see the collector as they expect


def test_freeze_moves_live_objects_out_of_collections(unfrozen: None) -> None:
    survivor = [[] for _ in range(1000)]  # lists are tracked by the collector
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count() >= len(survivor)
    assert sum(gc.get_count()) < 1000  # nothing left pending for the next collection
    cycle: list[object] = []
    cycle.append(cycle)  # garbage made after the freeze is still collected
    del cycle
    assert gc.collect() >= 1
