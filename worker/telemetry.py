"""The worker's side of observability: its periodic metric snapshot and the per-job outcome.

A worker serves no HTTP, so it records into Redis
(``scheduler.observability.metrics_recorder.RedisMetricsRecorder``)
and any API process exports the values on ``/metrics``; this works with workers on many hosts.

* :class:`TelemetryThread` publishes, every ``settings.observability.worker_metrics_interval`` seconds, the
  engine's tokens/s, batch occupancy and router counts (``Engine.stats()``), device memory,
  model load time and model version.
* :func:`observe_job_finished` is called once when a job reaches a final status: it writes the
  job summary log line and records the finished counter and the wait/run/steps/tokens
  histograms (best effort: a metrics failure never fails a job).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import torch

from scheduler.observability.logging import get_logger, log_job_finished
from scheduler.observability.metric_families import version_label
from scheduler.observability.metrics_recorder import RedisMetricsRecorder, WorkerSnapshot
from worker.engine.stats import EngineStats

log = get_logger(__name__)


def device_memory(device: str) -> dict[tuple[str, str], int]:
    """Memory of ``device`` as ``{(device, kind): bytes}`` with kind used|free|total.

    CUDA: free/total from the driver, used = total - free (what the 95% alert is about).
    CPU: used = this process's resident set size; total/free = the host's physical/available
    memory (the help text of ``cloverq_device_memory_bytes`` says so).
    """
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index
        free, total = torch.cuda.mem_get_info(index if index is not None else torch.cuda.current_device())
        name = f"cuda:{index if index is not None else torch.cuda.current_device()}"
        return {(name, "used"): int(total - free), (name, "free"): int(free), (name, "total"): int(total)}
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    free = os.sysconf("SC_AVPHYS_PAGES") * page
    return {
        ("cpu", "used"): _process_rss_bytes(page),
        ("cpu", "free"): int(free),
        ("cpu", "total"): int(total),
    }


def _process_rss_bytes(page_size: int) -> int:
    """Current resident set size (Linux ``/proc/self/statm``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * page_size
    except (OSError, IndexError, ValueError):
        return 0


def snapshot_from_stats(
    stats: EngineStats | None,
    *,
    worker_id: str,
    device: str,
    queues: tuple[str, ...],
    state: str,
    model_name: str | None,
    model_version: str | None,
    model_load_seconds: float | None,
    track: str | None = None,
) -> WorkerSnapshot:
    """The worker's snapshot from one ``Engine.stats()`` (None while the engine is not built)."""
    return WorkerSnapshot(
        worker=worker_id,
        tokens_per_second=stats.tokens_per_second if stats is not None else 0.0,
        batch_occupancy=stats.batch_occupancy if stats is not None else 0.0,
        model_load_seconds=model_load_seconds,
        model_name=model_name,
        model_version=model_version,
        device_memory=device_memory(device),
        router_counts=stats.router_counts if stats is not None and stats.router_counts else None,
        queues=queues,
        state=state,
        prefix_cache=_prefix_counters(stats),
        track=track,
    )


def _prefix_counters(stats: EngineStats | None) -> dict[str, int] | None:
    """The engine's prefix-cache counters for the snapshot (None while the cache is off)."""
    if stats is None or stats.prefix_cache_budget_bytes <= 0:
        return None
    return {
        "hits": stats.prefix_cache_hits,
        "misses": stats.prefix_cache_misses,
        "evictions": stats.prefix_cache_evictions,
        "bytes": stats.prefix_cache_bytes,
    }


class TelemetryThread:
    """Publishes ``snapshot()`` every ``interval`` seconds until :meth:`stop` (daemon thread)."""

    def __init__(
        self,
        recorder: RedisMetricsRecorder,
        snapshot: Callable[[], WorkerSnapshot],
        *,
        interval: float,
    ) -> None:
        self._recorder = recorder
        self._snapshot = snapshot
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cloverq-telemetry", daemon=True)
        self._worker: str | None = None

    def start(self) -> None:
        self._thread.start()

    def publish_now(self) -> bool:
        """One snapshot, now (also called at readiness so the dashboard sees the worker at once)."""
        try:
            snap = self._snapshot()
            self._worker = snap.worker
            self._recorder.publish_worker(snap, ttl_seconds=max(3 * self._interval, 10.0))
        except Exception as exc:  # best effort: Redis or stats trouble must not kill the worker
            log.warning("telemetry.publish_failed", error=f"{type(exc).__name__}: {exc}")
            return False
        return True

    def stop(self, *, remove: bool = True) -> None:
        """Stop publishing; with ``remove`` the snapshot is deleted at once (clean shutdown)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval + 1.0)
        if remove and self._worker is not None:
            self._recorder.safe(self._recorder.remove_worker, worker=self._worker)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.publish_now()
            self._stop.wait(self._interval)


def _seconds_between(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return max(0.0, (end - start).total_seconds())


def observe_job_finished(
    recorder: RedisMetricsRecorder | None,
    *,
    job_id: str,
    kind: str,
    queue: str,
    status: str,
    attempt: int,
    created_at: datetime | None,
    started_at: datetime | None,
    finished_at: datetime | None,
    steps_used: int | None,
    step_budget: int | None,
    tokens: int | None,
    model_version: str | None,
    finish_reason: str | None = None,
    error_code: str | None = None,
    request_id: str | None = None,
    logger: Any = None,
    track: str | None = None,
) -> None:
    """Summary log line + finished counter + wait/run/steps/tokens histograms for one job (and
    the per-version families: ``model_version``'s name and ``track``, canary or stable).

    ``wait`` is submission -> start of the finishing attempt, ``run`` that attempt's duration.
    """
    wait_seconds = _seconds_between(created_at, started_at)
    run_seconds = _seconds_between(started_at, finished_at)
    log_job_finished(
        logger or log,
        job_id=job_id,
        kind=kind,
        queue=queue,
        status=status,
        attempt=attempt,
        steps_used=steps_used,
        step_budget=step_budget,
        tokens=tokens,
        model_version=model_version,
        wait_seconds=wait_seconds,
        run_seconds=run_seconds,
        finish_reason=finish_reason,
        error_code=error_code,
        request_id=request_id,
    )
    if recorder is None:
        return
    recorded = recorder.safe(
        recorder.job_finished,
        kind=kind,
        queue=queue,
        status=status,
        wait_seconds=wait_seconds,
        run_seconds=run_seconds,
        steps_used=steps_used,
        tokens=tokens,
        version=version_label(model_version),
        track=track,
    )
    if not recorded:
        log.warning("metrics.record_failed", job_id=job_id)


@dataclass(frozen=True)
class JobFacts:
    """What the finish path needs from the claimed row for the summary line and the metrics."""

    created_at: datetime | None
    started_at: datetime | None
    step_budget: int | None
    request_id: str | None


_EXCEPTION_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\(")


def retry_reason(error: str) -> str:
    """A low-cardinality ``reason`` label for a retried attempt, from the error text."""
    lowered = error.lower()
    if "out of memory" in lowered:
        return "out_of_memory"
    if lowered.startswith("interrupted"):
        return "interrupted"
    match = _EXCEPTION_NAME.match(error)
    return match.group(1) if match else "other"
