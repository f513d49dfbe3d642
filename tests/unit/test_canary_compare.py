"""The dashboard's per-version comparison and the promotion gate's decision (pure, no server)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from api.version_compare import canaries, compare_versions
from scheduler.jobs.models import Job
from scheduler.model_versions.canary_gate import GateReport, VersionTally
from scheduler.model_versions.registry import Activation

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _job(version: str, status: str, seconds: float, steps: int) -> Job:
    return Job(id=uuid.uuid4(), model_version=f"{version}@abcdef012345", status=status, steps_used=steps,
               started_at=NOW, finished_at=NOW + timedelta(seconds=seconds))


def test_versions_side_by_side_canary_first() -> None:
    jobs = [_job("v1", "succeeded", 1.0, 8) for _ in range(9)] + [_job("v1", "failed", 3.0, 8)]
    jobs += [_job("v2", "succeeded", 0.5, 4), _job("v2", "succeeded", 0.7, 6)]
    workers = [{"model_version": "v1@abc", "state": "ready", "tokens_per_second": 10.0},
               {"model_version": "v1@abc", "state": "switching", "tokens_per_second": 5.0},
               {"model_version": "v2@def", "state": "ready", "tokens_per_second": 7.5}]
    active = {"demo": Activation(name="demo", version="v1", previous_version=None, generation=3,
                                 activated_at=NOW, activated_by="test", canary_version="v2",
                                 canary_basis_points=1000)}
    rows = compare_versions(jobs, workers, active=active, invalid_retries={"v2": 2.0})
    assert [(r["version"], r["track"]) for r in rows] == [("v2", "canary"), ("v1", "stable")]
    v2, v1 = rows
    assert (v2["jobs"], v2["failed"], v2["error_rate"], v2["steps_mean"]) == (2, 0, 0.0, 5.0)
    assert (v1["jobs"], v1["failed"], v1["error_rate"], v1["workers_ready"]) == (10, 1, 0.1, 1)
    assert v1["tokens_per_second"] == 15.0 and v2["invalid_output_retries"] == 2
    assert v1["run_p50"] == 1.0 and v2["run_p95"] is not None and v2["run_p95"] <= 0.7
    assert canaries(active) == [{"model": "demo", "stable": "v1", "canary": "v2", "percent": 10.0}]


def test_gate_report_shape() -> None:
    report = GateReport(canary=VersionTally("v2", finished=3, failed=1), stable=VersionTally("v1", 100, 1),
                        min_jobs=50, error_margin=0.01, reasons=["too few"])
    assert not report.ok
    out = report.as_dict()
    assert out["canary"] == {"version": "v2", "finished": 3, "failed": 1, "error_rate": 0.3333}
    assert out["stable"] == {"version": "v1", "finished": 100, "failed": 1, "error_rate": 0.01}
    assert out["reasons"] == ["too few"]
