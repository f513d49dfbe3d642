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
        "queues": [{"name": "interactive", "queued": 2, "running": 1, "workers_ready": 1, "drained": False},
                   {"name": "bulk", "queued": 1, "running": 0, "workers_ready": 1, "drained": True}],
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
        "bulk drained",
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


def test_frame_shows_model_versions_side_by_side() -> None:
    overview = _overview(4, 12.5)
    overview["versions"] = [
        {"version": "v2", "track": "canary", "workers_ready": 1, "jobs": 40, "failed": 2, "error_rate": 0.05,
         "run_p50": 0.2, "run_p95": 0.9, "steps_mean": 6.0, "tokens_per_second": 30.0,
         "invalid_output_retries": 3},
        {"version": "v1", "track": "stable", "workers_ready": 3, "jobs": 360, "failed": 0, "error_rate": 0.0,
         "run_p50": 0.3, "run_p95": 1.2, "steps_mean": 8.0, "tokens_per_second": 90.0,
         "invalid_output_retries": 0},
    ]
    overview["canaries"] = [{"model": "demo", "stable": "v1", "canary": "v2", "percent": 10.0}]
    console = Console(width=160, record=True)
    console.print(render(overview, url="http://api:8000", job_rate=None, tps_history=[]))
    text = console.export_text()
    for expected in ("model versions", "canary v2 at 10% of demo", "canary", "stable", "5.0%", "200ms/900ms"):
        assert expected in text, expected
