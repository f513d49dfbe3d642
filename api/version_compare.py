"""Model versions side by side for the dashboard and ``cloverq top`` (canary against stable).

Why here and not from Prometheus: the dashboard reads the admin API only, and the operator
deciding on ``promote`` wants the same record the promotion gate uses. Per version, over the
recent window of finished jobs the overview already reads: jobs, failures and error rate, run
time p50/p95, steps used; from the workers' snapshots: ready workers and tokens/s; from the
Redis counter: invalid-output retries. ``track`` says which version is the canary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from scheduler.jobs.models import Job, JobStatus
from scheduler.model_versions.registry import Activation
from scheduler.observability.metric_families import version_label


def _seconds(job: Job) -> float | None:
    if job.started_at is None or job.finished_at is None:
        return None
    return max(0.0, (job.finished_at - job.started_at).total_seconds())


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def compare_versions(
    jobs: Iterable[Job], workers: Sequence[Mapping[str, Any]], *, active: Mapping[str, Activation],
    invalid_retries: Mapping[str, float],
) -> list[dict[str, Any]]:
    """One row per version seen in ``jobs`` or served by ``workers``: canary first, then stable.

    ``invalid_retries``: retries per version name (from ``cloverq_version_invalid_output_retries_total``).
    """
    canaries = {a.canary_version for a in active.values() if a.canary_version}
    stables = {a.version for a in active.values()}
    runs: dict[str, list[float]] = {}
    steps: dict[str, list[float]] = {}
    failed: dict[str, int] = {}
    for job in jobs:  # the overview's window (LATENCY_WINDOW jobs)
        version = version_label(job.model_version)
        if version is None:
            continue
        seconds = _seconds(job)
        runs.setdefault(version, [])
        if seconds is not None:
            runs[version].append(seconds)
        steps.setdefault(version, []).append(float(job.steps_used or 0))
        failed[version] = failed.get(version, 0) + (job.status == JobStatus.FAILED.value)
    tokens: dict[str, float] = {}
    ready: dict[str, int] = {}
    for worker in workers:
        version = version_label(worker.get("model_version"))
        if version is None:
            continue
        tokens[version] = tokens.get(version, 0.0) + float(worker.get("tokens_per_second") or 0.0)
        ready[version] = ready.get(version, 0) + (worker.get("state") == "ready")
    rows = []
    for version in sorted(set(runs) | set(tokens), key=lambda v: (v not in canaries, v not in stables, v)):
        run = np.asarray(runs.get(version, []), dtype=np.float64)  # [n]
        n = len(steps.get(version, []))
        rows.append({
            "version": version,
            "track": "canary" if version in canaries else ("stable" if version in stables else ""),
            "workers_ready": ready.get(version, 0),
            "jobs": n,
            "failed": failed.get(version, 0),
            "error_rate": failed.get(version, 0) / n if n else None,
            "run_p50": _pct(run, 50),
            "run_p95": _pct(run, 95),
            "steps_mean": float(np.mean(steps[version])) if n else None,
            "tokens_per_second": round(tokens.get(version, 0.0), 2),
            "invalid_output_retries": int(invalid_retries.get(version, 0)),
        })
    return rows


def canaries(active: Mapping[str, Activation]) -> list[dict[str, Any]]:
    """The canaries in effect: model, stable and canary version, share in percent."""
    return [{"model": name, "stable": a.version, "canary": a.canary_version,
             "percent": a.canary_basis_points / 100}
            for name, a in sorted(active.items()) if a.canary_version]
