"""``cloverq top``: frame rendering and rate bookkeeping (pure; no server)."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from cli.top import Rates, render, sparkline


def _overview(finished: int, tps: float) -> dict[str, Any]:
    return {
        "generated_at": "2026-01-01T00:00:00+00:00",
        "counts": {
            "by_status": {"queued": 2, "running": 1, "succeeded": finished, "failed": 0},
            "by_queue": {"interactive": {"queued": 2, "running": 1, "succeeded": finished, "failed": 0}},
        },
        "queues": [{"name": "interactive", "queued": 2, "running": 1, "workers_ready": 1}],
        "workers": [
            {
                "worker": "w-7@host",
                "state": "ready",
                "queues": ["interactive", "standard"],
                "model_name": "demo",
                "model_version": "v3",
                "tokens_per_second": tps,
                "batch_occupancy": 0.5,
                "memory_used_bytes": 2 * 1024**3,
                "memory_total_bytes": 16 * 1024**3,
            }
        ],
        "model_versions": {"demo@v3": 1},
        "throughput": {"finished_last_minute": finished, "tokens_per_second": tps},
        "latency": {
            "interactive": {"n": 3, "wait": {"p50": 0.01, "p95": 0.2}, "run": {"p50": 1.0, "p95": 2.5}}
        },
    }


def test_rates_from_two_polls() -> None:
    rates = Rates()
    assert rates.update(_overview(10, 5.0), now=100.0) is None
    assert rates.update(_overview(16, 7.0), now=102.0) == 3.0
    assert list(rates.history) == [5.0, 7.0]


def test_frame_shows_queues_workers_and_throughput() -> None:
    console = Console(width=160, record=True)
    console.print(render(_overview(4, 12.5), url="http://api:8000", job_rate=1.5, tps_history=[1.0, 12.5]))
    text = console.export_text()
    for expected in (
        "interactive",
        "w-7@host",
        "demo@v3",
        "12.5 tok/s",
        "1.50 jobs/s",
        "50%",
        "2.0GiB/16.0GiB",
        "2.50s",
    ):
        assert expected in text, expected


def test_sparkline_scales_to_max() -> None:
    assert sparkline([0.0, 1.0]) == "▁█"
    assert sparkline([]) == ""
