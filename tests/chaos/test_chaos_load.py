"""Load: 64 concurrent clients submit and poll for two minutes (``bench.soak``'s driver, bounded
for CI). Zero 5xx, zero lost jobs, and the API and worker RSS grow < 5% after warm-up."""

from __future__ import annotations

import pytest

from bench.soak import run_load
from tests.chaos.conftest import ChaosStack

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

CLIENTS = 64
SECONDS = 120.0
WARMUP_SECONDS = 40.0
MAX_RSS_GROWTH = 0.05


def test_64_clients_for_two_minutes_no_5xx_nothing_lost_rss_flat(chaos_stack: ChaosStack) -> None:
    stack = chaos_stack
    stack.ensure_workers(2)
    workers = stack.live_workers()[:2]

    def pids() -> dict[str, int]:
        return {"api": stack.api.pid, **{f"worker{i}": w.pid for i, w in enumerate(workers)}}

    report = run_load(stack.api_url, clients=CLIENTS, seconds=SECONDS, warmup_seconds=WARMUP_SECONDS,
                      pids=pids, poll_interval=0.25, rss_every=5.0, settle_seconds=60.0)
    print("\n" + report.summary())
    assert report.server_errors == 0, report.statuses
    assert report.transport_errors == 0, report.transport_error_kinds
    assert set(report.statuses) <= {200, 202}, report.statuses
    assert len(report.accepted) > CLIENTS  # every client got work through, repeatedly
    assert not report.lost, f"{len(report.lost)} accepted jobs never became final"
    assert not report.not_succeeded, report.not_succeeded
    assert all(w.proc.poll() is None for w in workers)
    growth = report.rss_growth()
    assert set(growth) == set(pids())
    too_much = {name: f"{g * 100:+.1f}%" for name, g in growth.items() if g >= MAX_RSS_GROWTH}
    assert not too_much, f"RSS grew after warm-up: {too_much}\n{report.summary()}"
    rows = stack.rows(sorted(report.accepted))
    stack.assert_exactly_once(sorted(report.accepted), rows)
