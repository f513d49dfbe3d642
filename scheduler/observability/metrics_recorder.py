"""Workers' metrics, recorded into Redis (one pipelined round trip per event) and read back by
the API at scrape time (``cluster_metrics``): workers serve no HTTP, and Redis is already shared
by every process of a deployment, so this works across hosts without a pushgateway."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scheduler.infra.leader_lease import parse_value
from scheduler.infra.redis_keys import (
    BEAT_FENCE_KEY,
    BEAT_LEADER_KEY,
    BEAT_MEMBERS_SET,
    METRICS_WORKERS_SET,
    beat_member,
    metrics_counter,
    metrics_histogram,
    metrics_worker,
)
from scheduler.observability.metric_families import FAMILIES, process_version

# ------------------------------------------------------------------------------------------
# Worker side: recording into Redis
# ------------------------------------------------------------------------------------------


def _labels_field(label_values: Sequence[str]) -> str:
    return json.dumps([str(v) for v in label_values], separators=(",", ":"))


def _bucket_index(buckets: Sequence[float], value: float) -> int:
    """Index of the first bucket whose upper bound holds ``value`` (len(buckets) = +Inf)."""
    return int(np.searchsorted(np.asarray(buckets, dtype=np.float64), value, side="left"))


@dataclass
class WorkerSnapshot:
    """What a worker publishes about itself every few seconds (see ``cloverq_worker_*``)."""

    worker: str
    tokens_per_second: float = 0.0
    batch_occupancy: float = 0.0
    model_load_seconds: float | None = None
    model_name: str | None = None
    model_version: str | None = None
    # (device, kind) -> bytes, kind in used|free|total
    device_memory: dict[tuple[str, str], int] = field(default_factory=dict)
    # tokens routed per expert, [L, E]; None if the engine reports none
    router_counts: Sequence[Sequence[float]] | None = None
    queues: tuple[str, ...] = ()
    state: str = "ready"
    # the engine's prefix-cache counters: hits, misses, evictions, bytes; None while it is off
    prefix_cache: Mapping[str, int] | None = None
    track: str | None = None  # canary|stable lane of a worker serving a store model

    def to_payload(self) -> dict[str, Any]:
        """JSON-ready form, with expert shares and imbalance precomputed (vectorised).

        Layers that routed no token (dense ``mlp_only_layers``, or no traffic yet) are left
        out: a share or an imbalance of nothing would only mislead a dashboard.
        """
        share: dict[str, list[float]] = {}
        imbalance: dict[str, float] = {}
        if self.router_counts is not None and len(self.router_counts) > 0:
            counts = np.asarray(self.router_counts, dtype=np.float64)  # [L, E]
            totals = counts.sum(axis=1, keepdims=True)  # [L, 1]
            routed = np.flatnonzero(totals[:, 0] > 0)  # [L'] layers that saw tokens
            share_arr = counts[routed] / totals[routed]  # [L', E]
            imb = counts[routed].max(axis=1) / counts[routed].mean(axis=1)  # [L']
            layers = [str(i) for i in routed.tolist()]
            share = dict(zip(layers, share_arr.tolist(), strict=True))
            imbalance = dict(zip(layers, imb.tolist(), strict=True))
        return {
            "worker": self.worker,
            "updated_at": time.time(),
            "tokens_per_second": float(self.tokens_per_second),
            "batch_occupancy": float(self.batch_occupancy),
            "model_load_seconds": self.model_load_seconds,
            "model_name": self.model_name,
            "model_version": self.model_version,
            "device_memory": [
                {"device": device, "kind": kind, "bytes": int(n)}
                for (device, kind), n in self.device_memory.items()
            ],
            "expert_share": share,
            "expert_imbalance": imbalance,
            "queues": list(self.queues),
            "state": self.state,
            "prefix_cache": dict(self.prefix_cache) if self.prefix_cache is not None else None,
            "track": self.track,
        }


class RedisMetricsRecorder:
    """Records worker-side metrics into Redis hashes; one pipelined round trip per event.

    ``client`` is a ``redis.Redis`` (sync). Failures to record are the caller's to swallow:
    metrics must never fail a job, so the worker wraps calls in :meth:`safe`.
    """

    def __init__(self, client: Any) -> None:
        self._client = client

    def job_finished(
        self,
        *,
        kind: str,
        queue: str,
        status: str,
        wait_seconds: float | None,
        run_seconds: float | None,
        steps_used: int | None,
        tokens: int | None,
        version: str | None = None,
        track: str | None = None,
    ) -> None:
        """One job reached a final status: the counter plus its four histograms; with ``version``
        (the model version that ran it) also the per-version counter and histograms."""
        pipe = self._client.pipeline(transaction=False)
        pipe.hincrbyfloat(
            metrics_counter("cloverq_jobs_finished_total"), _labels_field((kind, queue, status)), 1
        )
        observations = (
            ("cloverq_job_queue_wait_seconds", wait_seconds),
            ("cloverq_job_run_seconds", run_seconds),
            ("cloverq_job_steps_used", steps_used),
            ("cloverq_job_tokens", tokens),
        )
        labels = _labels_field((kind, queue))
        for name, value in observations:  # four histograms, not a per-token loop
            if value is not None:
                self._observe(pipe, name, labels, float(value))
        if version is not None:
            pair = (version, track or "stable")
            pipe.hincrbyfloat(metrics_counter("cloverq_version_jobs_finished_total"),
                              _labels_field((*pair, status)), 1)
            for name, value in (("cloverq_version_job_run_seconds", run_seconds),
                                ("cloverq_version_job_steps_used", steps_used)):
                if value is not None:
                    self._observe(pipe, name, _labels_field(pair), float(value))
        pipe.execute()

    def job_claimed(self, *, queue: str, tenant: str, wait_seconds: float) -> None:
        """A worker claimed a tenant's job after ``wait_seconds`` due (the per-tenant wait and share)."""
        pipe = self._client.pipeline(transaction=False)
        self._observe(pipe, "cloverq_tenant_queue_wait_seconds", _labels_field((queue, tenant)),
                      max(0.0, wait_seconds))
        pipe.execute()

    def job_retried(self, *, kind: str, queue: str, reason: str) -> None:
        self._client.hincrbyfloat(
            metrics_counter("cloverq_job_retries_total"), _labels_field((kind, queue, reason)), 1
        )

    def trace_spans_dropped(self, *, process: str, reason: str, count: int) -> None:
        """Spans a worker or beat process lost (``scheduler.observability.tracing.set_drop_sink``)."""
        self._client.hincrbyfloat(metrics_counter("cloverq_process_trace_spans_dropped_total"),
                                  _labels_field((process, reason)), count)

    def dead_letter(self, *, kind: str, queue: str) -> None:
        self._client.hincrbyfloat(metrics_counter("cloverq_dead_letters_total"),
                                  _labels_field((kind, queue)), 1)

    def invalid_output_retry(self, *, kind: str) -> None:
        pipe = self._client.pipeline(transaction=False)
        pipe.hincrbyfloat(metrics_counter("cloverq_invalid_output_retries_total"), _labels_field((kind,)), 1)
        served = process_version()
        if served is not None:  # a worker serving a version: count it there too
            pipe.hincrbyfloat(metrics_counter("cloverq_version_invalid_output_retries_total"),
                              _labels_field(served), 1)
        pipe.execute()

    def consumer_healed(self, *, queue: str) -> None:
        self._client.hincrbyfloat(metrics_counter("cloverq_worker_consumer_heals_total"),
                                  _labels_field((queue,)), 1)

    def publish_worker(self, snapshot: WorkerSnapshot, *, ttl_seconds: float = 30.0) -> None:
        """Store the worker's snapshot; it disappears from ``/metrics`` ``ttl_seconds`` after the
        worker stops publishing (a dead worker must not look alive on a dashboard)."""
        pipe = self._client.pipeline(transaction=False)
        pipe.set(metrics_worker(snapshot.worker), json.dumps(snapshot.to_payload()),
                 px=int(ttl_seconds * 1000))
        pipe.sadd(METRICS_WORKERS_SET, snapshot.worker)
        pipe.execute()

    def remove_worker(self, worker: str) -> None:
        """Drop a worker's snapshot at clean shutdown."""
        pipe = self._client.pipeline(transaction=False)
        pipe.delete(metrics_worker(worker))
        pipe.srem(METRICS_WORKERS_SET, worker)
        pipe.execute()

    @staticmethod
    def _observe(pipe: Any, name: str, labels: str, value: float) -> None:
        buckets = FAMILIES[name].buckets
        key = metrics_histogram(name)
        pipe.hincrbyfloat(key, f"{labels}|b{_bucket_index(buckets, value)}", 1)
        pipe.hincrbyfloat(key, f"{labels}|sum", value)
        pipe.hincrbyfloat(key, f"{labels}|count", 1)

    def safe(self, fn: Callable[..., None], /, **kwargs: Any) -> bool:
        """Run one recording call; on a Redis error return False instead of raising."""
        try:
            fn(**kwargs)
        except Exception:  # metrics are best effort: a Redis hiccup must not fail the job
            return False
        return True


def read_worker_snapshots(client: Any) -> list[dict[str, Any]]:
    """All live worker snapshots (expired ones are dropped from the index as a side effect)."""
    names = sorted(n.decode() if isinstance(n, bytes) else str(n)
                   for n in client.smembers(METRICS_WORKERS_SET))
    if not names:
        return []
    raw = client.mget([metrics_worker(n) for n in names])
    live: list[dict[str, Any]] = []
    stale: list[str] = []
    for name, blob in zip(names, raw, strict=True):
        if blob is None:
            stale.append(name)
        else:
            live.append(json.loads(blob))
    if stale:
        client.srem(METRICS_WORKERS_SET, *stale)
    return live


def read_beat_leadership(client: Any) -> tuple[dict[str, bool], int]:
    """Each live beat process -> whether it holds the leader lease, and the lease's fencing number
    (``scheduler/maintenance/beat_leader.py`` publishes them; expired ones leave the index here)."""
    names = sorted(_decode(n) for n in client.smembers(BEAT_MEMBERS_SET))
    pipe = client.pipeline(transaction=False)
    pipe.get(BEAT_LEADER_KEY)
    pipe.get(BEAT_FENCE_KEY)
    for name in names:
        pipe.exists(beat_member(name))
    lease, fence, *alive = pipe.execute()
    holder = parse_value(lease)
    stale = [name for name, up in zip(names, alive, strict=True) if not up]
    if stale:
        client.srem(BEAT_MEMBERS_SET, *stale)
    beats = {name: False for name, up in zip(names, alive, strict=True) if up}
    if holder is not None:
        beats[holder.name] = True
    return beats, int(_decode(fence)) if fence is not None else 0


def read_version_invalid_retries(client: Any) -> dict[str, float]:
    """Invalid-output retries per model version name (both tracks summed), for the dashboard."""
    out: dict[str, float] = {}
    counts = client.hgetall(metrics_counter("cloverq_version_invalid_output_retries_total")) or {}
    for raw_labels, raw_value in counts.items():
        version = json.loads(_decode(raw_labels))[0]
        out[version] = out.get(version, 0.0) + float(_decode(raw_value))
    return out


def _decode(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)

