"""Prometheus metrics of cloverq: the family names, who records what, and how it is exported.

Two kinds of producers write metrics, and they reach Prometheus by two different paths:

* **API processes** record HTTP traffic and job submissions in-process with prometheus-client
  (a counter increment: the submit path stays cheap). Every API replica is its own scrape
  target. When one host runs several API worker processes, ``PROMETHEUS_MULTIPROC_DIR`` is set
  (see :func:`reset_multiprocess_dir`) and the exposition merges their mmap files.
* **Workers** (Celery processes, possibly on many hosts, serving no HTTP) record job outcomes,
  retries and their own gauges into **Redis** (:class:`RedisMetricsRecorder`); any API
  process's ``/metrics`` reads them back at scrape time (:class:`ClusterCollector`). Redis is
  already shared by every process of a deployment, so this works across hosts without a
  pushgateway. These families are *cluster-wide*: every API replica exports the same values,
  so aggregate them with ``max without (instance)`` (not ``sum``) when scraping several API
  replicas, or scrape one replica for them.

``FAMILIES`` is the single list of names (the contract with the alert rules and the Grafana
dashboard in ``deploy/``); tests check that every exported family is in it and vice versa.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import structlog
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
    values,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.registry import Collector

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
from scheduler.infra.settings import Settings

log = structlog.get_logger(__name__)

MetricType = Literal["counter", "gauge", "histogram"]

# ``*_created`` series double the exposition and nothing here uses them.
disable_created_metrics()

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
RUN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
HTTP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@dataclass(frozen=True)
class FamilySpec:
    """One metric family: its type, label names, help text and (histograms) bucket bounds."""

    type: MetricType
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()


FAMILIES: dict[str, FamilySpec] = {
    # --- recorded in the API process ------------------------------------------------------
    "cloverq_jobs_submitted_total": FamilySpec(
        "counter", ("kind", "queue"), "Jobs accepted by the API (new rows, not idempotent repeats)."
    ),
    "cloverq_http_requests_total": FamilySpec(
        "counter", ("route", "method", "status"), "HTTP requests by route template, method and status."
    ),
    "cloverq_http_request_seconds": FamilySpec(
        "histogram", ("route", "method"), "HTTP request latency in seconds.", HTTP_BUCKETS
    ),
    "cloverq_trace_spans_dropped_total": FamilySpec(
        "counter", ("reason",), "Finished spans this process did not deliver to the collector: queue_full "
        "(the bounded export queue was full) or export_failed (the collector refused or did not answer).",
    ),
    "cloverq_network_refusals_total": FamilySpec(
        "counter", ("plane", "reason"), "Requests refused for their caller's network address (403 "
        "network_not_allowed): reason plane (outside the plane's allow-list) or key (outside the API "
        "key's allowed_networks); plane is public, admin or ops.",
    ),
    # --- recorded by workers into Redis ---------------------------------------------------
    "cloverq_process_trace_spans_dropped_total": FamilySpec(
        "counter", ("process", "reason"), "Finished spans worker and beat processes did not deliver to "
        "the collector (reason as cloverq_trace_spans_dropped_total; recorded into Redis by the export "
        "thread, the API process's own drops are in cloverq_trace_spans_dropped_total).",
    ),
    "cloverq_jobs_finished_total": FamilySpec(
        "counter", ("kind", "queue", "status"), "Jobs that reached a final status."
    ),
    "cloverq_job_queue_wait_seconds": FamilySpec(
        "histogram",
        ("kind", "queue"),
        "Time from submission to the start of the finishing attempt.",
        WAIT_BUCKETS,
    ),
    "cloverq_job_run_seconds": FamilySpec(
        "histogram",
        ("kind", "queue"),
        "Time from the start of the finishing attempt to its end.",
        RUN_BUCKETS,
    ),
    "cloverq_job_steps_used": FamilySpec(
        "histogram", ("kind", "queue"), "Denoising passes a finished job used.", STEP_BUCKETS
    ),
    "cloverq_job_tokens": FamilySpec(
        "histogram", ("kind", "queue"), "Tokens a finished job generated.", TOKEN_BUCKETS
    ),
    "cloverq_job_retries_total": FamilySpec(
        "counter", ("kind", "queue", "reason"), "Job attempts retried after a transient fault."
    ),
    "cloverq_dead_letters_total": FamilySpec(
        "counter", ("kind", "queue"), "Jobs failed for good after their last attempt (retries_exhausted)."
    ),
    "cloverq_invalid_output_retries_total": FamilySpec(
        "counter", ("kind",), "Decoding retries because the output did not validate."
    ),
    "cloverq_worker_consumer_heals_total": FamilySpec(
        "counter", ("queue",), "Times a worker found its Celery consumer on (or off) a queue against what it "
        "had left it with, and put it right (worker/consumers.py)."
    ),
    # Per model version, side by side during a canary (track: canary|stable, the worker's lane).
    "cloverq_version_jobs_finished_total": FamilySpec(
        "counter", ("version", "track", "status"), "Jobs that reached a final status, by the model version "
        "and track (canary|stable) of the worker that ran them."
    ),
    "cloverq_version_job_run_seconds": FamilySpec(
        "histogram", ("version", "track"), "Run time of a job's finishing attempt, by model version.",
        RUN_BUCKETS,
    ),
    "cloverq_version_job_steps_used": FamilySpec(
        "histogram", ("version", "track"), "Denoising passes a finished job used, by model version.",
        STEP_BUCKETS,
    ),
    "cloverq_version_invalid_output_retries_total": FamilySpec(
        "counter", ("version", "track"),
        "Decoding retries because the output did not validate, by model version.",
    ),
    # --- published by workers as periodic snapshots in Redis ------------------------------
    "cloverq_worker_tokens_per_second": FamilySpec(
        "gauge", ("worker",), "Tokens committed per second by the worker's engine (recent window)."
    ),
    "cloverq_worker_batch_occupancy": FamilySpec(
        "gauge", ("worker",), "Active sequences / engine batch capacity (0..1)."
    ),
    "cloverq_model_load_seconds": FamilySpec(
        "gauge", ("worker",), "Seconds the worker took to load its model."
    ),
    "cloverq_model_info": FamilySpec(
        "gauge", ("worker", "name", "version"), "The model a worker serves (value is always 1)."
    ),
    "cloverq_device_memory_bytes": FamilySpec(
        "gauge",
        ("worker", "device", "kind"),
        "Device memory by kind (used|free|total). On CUDA from the driver; on CPU, used is the "
        "worker process RSS and total/free are the host's system memory.",
    ),
    "cloverq_expert_token_share": FamilySpec(
        "gauge", ("worker", "layer", "expert"), "Share of routed tokens per expert and layer (since start)."
    ),
    "cloverq_expert_load_imbalance": FamilySpec(
        "gauge",
        ("worker", "layer"),
        "Max over mean of tokens per expert in a layer (1 = balanced; layers routing no token omitted).",
    ),
    "cloverq_version_tokens_per_second": FamilySpec(
        "gauge", ("version", "track"), "Tokens committed per second by the workers serving a model version."
    ),
    "cloverq_prefix_cache_events_total": FamilySpec(
        "counter",
        ("worker", "event"),
        "Prefix cache of the worker's engine since it started: event hit (a sequence started from a "
        "stored prompt prefix), miss (a prompt with whole blocks found none stored), evict.",
    ),
    "cloverq_prefix_cache_bytes": FamilySpec(
        "gauge", ("worker",),
        "Bytes of shared prompt prefixes the worker's engine keeps (at most prefix_cache_bytes).",
    ),
    "cloverq_tenant_queue_wait_seconds": FamilySpec(
        "histogram", ("queue", "tenant"), "Time a tenant's job waited while due (available -> claimed), "
        "recorded when a worker claims it; its rate by tenant is each tenant's served share of a class "
        "(fair share, scheduler/fairness/).", WAIT_BUCKETS,
    ),
    # --- computed at scrape time ----------------------------------------------------------
    "cloverq_queue_depth": FamilySpec("gauge", ("queue",), "Jobs waiting (status queued) per queue."),
    "cloverq_tenant_queue_depth": FamilySpec(
        "gauge", ("queue", "tenant"), "Jobs queued per class and tenant (SQL: held by fair share or waiting "
        "in the broker list; delayed ones included)."),
    "cloverq_tenant_oldest_wait_seconds": FamilySpec(
        "gauge", ("queue", "tenant"), "Seconds the tenant's oldest due queued job of the class has waited "
        "(SQL; 0 when none is due)."),
    "cloverq_workers_ready": FamilySpec(
        "gauge", ("queue",), "Ready workers whose Celery consumer consumes each queue (read back from it)."),
    "cloverq_workers_queue_unconsumed": FamilySpec(
        "gauge", ("queue",), "Ready workers that should consume the queue (configured, not drained, no gate "
        "full, not switching) but whose Celery consumer does not."),
    "cloverq_beat_leader": FamilySpec(
        "gauge", ("beat",), "1 for the beat process (host:pid) that holds the leader lease and dispatches "
        "the periodic tasks, 0 for each standby (read from Redis at scrape time; a stopped beat drops out "
        "within one lease). No series at 1: no beat dispatches anything."),
    "cloverq_beat_leader_changes_total": FamilySpec(
        "counter", (), "Times a beat process took the leader lease (the lease's fencing number: the first "
        "leader counts 1, every takeover one more; starts again with an emptied Redis)."),
}

METRIC_NAMES: frozenset[str] = frozenset(FAMILIES)

# Families the worker records into Redis, by type.
REDIS_COUNTERS: tuple[str, ...] = (
    "cloverq_jobs_finished_total",
    "cloverq_job_retries_total",
    "cloverq_dead_letters_total",
    "cloverq_invalid_output_retries_total",
    "cloverq_worker_consumer_heals_total",
    "cloverq_version_jobs_finished_total",
    "cloverq_version_invalid_output_retries_total",
    "cloverq_process_trace_spans_dropped_total",
)
REDIS_HISTOGRAMS: tuple[str, ...] = (
    "cloverq_job_queue_wait_seconds",
    "cloverq_job_run_seconds",
    "cloverq_job_steps_used",
    "cloverq_job_tokens",
    "cloverq_version_job_run_seconds",
    "cloverq_version_job_steps_used",
    "cloverq_tenant_queue_wait_seconds",
)

# The (version, track) a worker process serves now, for families recorded deep inside a job where
# no version is at hand (invalid-output retries). One resident model per process (architecture
# §3.6) and no job claimed during a switch make a process-wide value exact.
_process_version: tuple[str, str] | None = None


def set_process_version(version: str | None, track: str | None) -> None:
    """Called by the worker runtime whenever it loads a version or changes lanes."""
    global _process_version
    _process_version = (version, track or "stable") if version else None


def version_label(model_version: str | None) -> str | None:
    """The version name of a worker's ``<version>@<manifest digest>`` label."""
    return model_version.split("@", 1)[0] if model_version else None


def _prom_name(name: str) -> str:
    """prometheus-client wants counter names without the ``_total`` suffix."""
    return name.removesuffix("_total")


# ------------------------------------------------------------------------------------------
# In-process metrics of the API
# ------------------------------------------------------------------------------------------

PROCESS_REGISTRY = CollectorRegistry(auto_describe=True)

_submitted_spec = FAMILIES["cloverq_jobs_submitted_total"]
JOBS_SUBMITTED = Counter(
    _prom_name("cloverq_jobs_submitted_total"),
    _submitted_spec.help,
    _submitted_spec.labels,
    registry=PROCESS_REGISTRY,
)
_http_spec = FAMILIES["cloverq_http_requests_total"]
HTTP_REQUESTS = Counter(
    _prom_name("cloverq_http_requests_total"), _http_spec.help, _http_spec.labels, registry=PROCESS_REGISTRY
)
_http_seconds_spec = FAMILIES["cloverq_http_request_seconds"]
HTTP_REQUEST_SECONDS = Histogram(
    "cloverq_http_request_seconds",
    _http_seconds_spec.help,
    _http_seconds_spec.labels,
    buckets=_http_seconds_spec.buckets,
    registry=PROCESS_REGISTRY,
)


_dropped_spec = FAMILIES["cloverq_trace_spans_dropped_total"]
TRACE_SPANS_DROPPED = Counter(
    _prom_name("cloverq_trace_spans_dropped_total"), _dropped_spec.help, _dropped_spec.labels,
    registry=PROCESS_REGISTRY,
)


_refusals_spec = FAMILIES["cloverq_network_refusals_total"]
NETWORK_REFUSALS = Counter(
    _prom_name("cloverq_network_refusals_total"), _refusals_spec.help, _refusals_spec.labels,
    registry=PROCESS_REGISTRY,
)


def record_network_refusal(*, plane: str, reason: str) -> None:
    """Count one request refused for its caller's address (in-process; no I/O)."""
    NETWORK_REFUSALS.labels(plane=plane, reason=reason).inc()


def record_spans_dropped(*, reason: str, count: int = 1) -> None:
    """Count finished spans that never reached the collector (in-process; no I/O: it runs on the
    request path when the export queue is full)."""
    TRACE_SPANS_DROPPED.labels(reason=reason).inc(count)


def record_submitted(*, kind: str, queue: str) -> None:
    """Count one accepted submission (in-process; no I/O)."""
    JOBS_SUBMITTED.labels(kind=kind, queue=queue).inc()


def record_http_request(*, route: str, method: str, status: int, seconds: float,
                        trace_id: str | None = None) -> None:
    """Count one HTTP request and observe its latency (in-process; no I/O). ``trace_id``: the
    request's recorded trace, kept as the latency bucket's exemplar (OpenMetrics exposition only;
    prometheus-client keeps none in multiprocess mode)."""
    HTTP_REQUESTS.labels(route=route, method=method, status=str(status)).inc()
    HTTP_REQUEST_SECONDS.labels(route=route, method=method).observe(
        seconds, exemplar={"trace_id": trace_id} if trace_id else None)


def multiprocess_enabled() -> bool:
    """True when prometheus-client runs in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set
    before it was imported): values then live in mmap files shared by the host's API processes."""
    return values.ValueClass is not values.MutexValue


def reset_multiprocess_dir(path: Path) -> Path:
    """Empty (or create) the multiprocess directory; call in the launcher before it starts the
    API processes with ``PROMETHEUS_MULTIPROC_DIR=path`` in their environment, so counts of a
    previous run do not leak into this one."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def enable_multiprocess(settings: Settings) -> Path:
    """Prepare multiprocess mode for a launcher about to start several API processes on this
    host: empties the directory and exports ``PROMETHEUS_MULTIPROC_DIR`` so the children (which
    import prometheus-client afresh) write their values there and ``/metrics`` merges them."""
    path = settings.observability.prometheus_multiproc_dir or (settings.data_dir / "prometheus-multiproc")
    reset_multiprocess_dir(path)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)  # read by prometheus-client in the children
    return path


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
        if _process_version is not None:  # a worker serving a version: count it there too
            pipe.hincrbyfloat(metrics_counter("cloverq_version_invalid_output_retries_total"),
                              _labels_field(_process_version), 1)
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


# ------------------------------------------------------------------------------------------
# Export: the collector that reads Redis (and the scrape-time gauges)
# ------------------------------------------------------------------------------------------


def _decode(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class ClusterCollector(Collector):
    """Yields the Redis-backed and scrape-time families on every scrape.

    ``redis_client``: where workers record. ``queue_depths``/``workers_ready``: callables
    returning ``{queue: n}`` (the API passes SQL-/registry-backed ones); when absent the
    values come from worker snapshots (ready workers) or are not exported (depth).
    ``tenant_queues``: ``{(queue, tenant): (queued, oldest due wait in s)}`` (SQL), or None.
    """

    def __init__(
        self,
        redis_client: Any,
        *,
        queue_depths: Callable[[], Mapping[str, int]] | None = None,
        workers_ready: Callable[[], Mapping[str, int]] | None = None,
        workers_unconsumed: Callable[[], Mapping[str, int]] | None = None,
        tenant_queues: Callable[[], Mapping[tuple[str, str], tuple[int, float]]] | None = None,
    ) -> None:
        self._redis = redis_client
        self._queue_depths = queue_depths
        self._tenant_queues = tenant_queues
        self._workers_ready = workers_ready
        self._workers_unconsumed = workers_unconsumed

    def describe(self) -> Iterable[Metric]:
        return []  # registering must not touch Redis

    def collect(self) -> Iterator[Metric]:
        """Every cluster-wide family. A source that is down (Redis, SQL) drops only the families
        it feeds, with a warning: ``/metrics`` still answers with the rest (an absent series is
        what the alert rules expect from an outage, never a scrape error)."""
        try:
            yield from self._collect_redis()
        except Exception as exc:  # Redis down or slow: skip its families
            log.warning("metrics.redis_unavailable", error=f"{type(exc).__name__}: {exc}")
        try:
            depths = self._queue_depths() if self._queue_depths is not None else {}
        except Exception as exc:  # database down: skip the depth gauge
            log.warning("metrics.queue_depth_unavailable", error=f"{type(exc).__name__}: {exc}")
        else:
            yield self._gauge_by_queue("cloverq_queue_depth", depths)
        if self._tenant_queues is not None:
            try:
                yield from self._tenant_families(self._tenant_queues())
            except Exception as exc:  # database down: skip the per-tenant gauges
                log.warning("metrics.tenant_queues_unavailable", error=f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _tenant_families(by_tenant: Mapping[tuple[str, str], tuple[int, float]]) -> Iterator[Metric]:
        depth = GaugeMetricFamily("cloverq_tenant_queue_depth", FAMILIES["cloverq_tenant_queue_depth"].help,
                                  labels=FAMILIES["cloverq_tenant_queue_depth"].labels)
        oldest = GaugeMetricFamily("cloverq_tenant_oldest_wait_seconds",
                                   FAMILIES["cloverq_tenant_oldest_wait_seconds"].help,
                                   labels=FAMILIES["cloverq_tenant_oldest_wait_seconds"].labels)
        for (queue, tenant), (queued, waited) in sorted(by_tenant.items()):
            depth.add_metric([queue, tenant], float(queued))
            oldest.add_metric([queue, tenant], float(waited))
        yield from (depth, oldest)

    def _collect_redis(self) -> Iterator[Metric]:
        pipe = self._redis.pipeline(transaction=False)
        for name in REDIS_COUNTERS:
            pipe.hgetall(metrics_counter(name))
        for name in REDIS_HISTOGRAMS:
            pipe.hgetall(metrics_histogram(name))
        results = pipe.execute()
        snapshots = read_worker_snapshots(self._redis)
        ready = self._workers_ready() if self._workers_ready is not None else ready_from_snapshots(snapshots)
        counter_data = results[: len(REDIS_COUNTERS)]
        histogram_data = results[len(REDIS_COUNTERS) :]
        for name, data in zip(REDIS_COUNTERS, counter_data, strict=True):
            yield self._counter(name, data)
        for name, data in zip(REDIS_HISTOGRAMS, histogram_data, strict=True):
            yield self._histogram(name, data)
        yield from self._worker_families(snapshots)
        yield from self._beat_families(*read_beat_leadership(self._redis))
        yield self._gauge_by_queue("cloverq_workers_ready", ready)
        if self._workers_unconsumed is not None:
            yield self._gauge_by_queue("cloverq_workers_queue_unconsumed", self._workers_unconsumed())

    @staticmethod
    def _counter(name: str, data: Mapping[Any, Any]) -> CounterMetricFamily:
        spec = FAMILIES[name]
        family = CounterMetricFamily(_prom_name(name), spec.help, labels=spec.labels)
        for raw_labels, raw_value in sorted(data.items()):
            family.add_metric(json.loads(_decode(raw_labels)), float(_decode(raw_value)))
        return family

    @staticmethod
    def _histogram(name: str, data: Mapping[Any, Any]) -> HistogramMetricFamily:
        spec = FAMILIES[name]
        family = HistogramMetricFamily(name, spec.help, labels=spec.labels)
        per_labels: dict[str, dict[str, float]] = {}
        for raw_field, raw_value in data.items():
            labels, _, part = _decode(raw_field).rpartition("|")
            per_labels.setdefault(labels, {})[part] = float(_decode(raw_value))
        bounds = [*spec.buckets, float("inf")]
        for labels, parts in sorted(per_labels.items()):
            counts = np.asarray([parts.get(f"b{i}", 0.0) for i in range(len(bounds))])  # [nb]
            cumulative = np.cumsum(counts)  # [nb]
            family.add_metric(
                json.loads(labels),
                [(_bound(b), float(c)) for b, c in zip(bounds, cumulative, strict=True)],
                sum_value=parts.get("sum", 0.0),
            )
        return family

    @staticmethod
    def _beat_families(beats: Mapping[str, bool], fence: int) -> Iterator[Metric]:
        leader = GaugeMetricFamily("cloverq_beat_leader", FAMILIES["cloverq_beat_leader"].help,
                                   labels=FAMILIES["cloverq_beat_leader"].labels)
        for name, leads in sorted(beats.items()):
            leader.add_metric([name], 1.0 if leads else 0.0)
        changes = CounterMetricFamily(_prom_name("cloverq_beat_leader_changes_total"),
                                      FAMILIES["cloverq_beat_leader_changes_total"].help, labels=())
        changes.add_metric([], float(fence))
        yield from (leader, changes)

    @staticmethod
    def _gauge_by_queue(name: str, by_queue: Mapping[str, int]) -> GaugeMetricFamily:
        spec = FAMILIES[name]
        family = GaugeMetricFamily(name, spec.help, labels=spec.labels)
        for queue, n in sorted(by_queue.items()):
            family.add_metric([queue], float(n))
        return family

    @staticmethod
    def _worker_families(snapshots: Sequence[Mapping[str, Any]]) -> Iterator[Metric]:
        def gauge(name: str) -> GaugeMetricFamily:
            spec = FAMILIES[name]
            return GaugeMetricFamily(name, spec.help, labels=spec.labels)

        tps = gauge("cloverq_worker_tokens_per_second")
        occupancy = gauge("cloverq_worker_batch_occupancy")
        load = gauge("cloverq_model_load_seconds")
        info = gauge("cloverq_model_info")
        memory = gauge("cloverq_device_memory_bytes")
        share = gauge("cloverq_expert_token_share")
        imbalance = gauge("cloverq_expert_load_imbalance")
        events_spec = FAMILIES["cloverq_prefix_cache_events_total"]
        prefix_events = CounterMetricFamily(
            _prom_name("cloverq_prefix_cache_events_total"), events_spec.help, labels=events_spec.labels
        )
        prefix_bytes = gauge("cloverq_prefix_cache_bytes")
        by_version: dict[tuple[str, str], float] = {}
        for snap in snapshots:  # one entry per worker process
            worker = str(snap["worker"])
            tps.add_metric([worker], float(snap.get("tokens_per_second") or 0.0))
            occupancy.add_metric([worker], float(snap.get("batch_occupancy") or 0.0))
            if snap.get("model_load_seconds") is not None:
                load.add_metric([worker], float(snap["model_load_seconds"]))
            version = version_label(snap.get("model_version"))
            if version is not None:
                pair = (version, str(snap.get("track") or "stable"))
                by_version[pair] = by_version.get(pair, 0.0) + float(snap.get("tokens_per_second") or 0.0)
            if snap.get("model_version") is not None or snap.get("model_name") is not None:
                info.add_metric(
                    [worker, str(snap.get("model_name") or ""), str(snap.get("model_version") or "")], 1
                )
            for entry in snap.get("device_memory", []):
                memory.add_metric([worker, str(entry["device"]), str(entry["kind"])], float(entry["bytes"]))
            for layer, row in snap.get("expert_share", {}).items():
                for expert, value in enumerate(row):  # exposition is text: one line per series
                    share.add_metric([worker, layer, str(expert)], float(value))
            for layer, value in snap.get("expert_imbalance", {}).items():
                imbalance.add_metric([worker, layer], float(value))
            prefix = snap.get("prefix_cache")
            if prefix:
                for event, key in (("hit", "hits"), ("miss", "misses"), ("evict", "evictions")):
                    prefix_events.add_metric([worker, event], float(prefix.get(key) or 0))
                prefix_bytes.add_metric([worker], float(prefix.get("bytes") or 0))
        per_version = gauge("cloverq_version_tokens_per_second")
        for pair, value in sorted(by_version.items()):
            per_version.add_metric(list(pair), value)
        yield from (tps, occupancy, load, info, memory, share, imbalance, per_version)
        yield from (prefix_events, prefix_bytes)


def _bound(b: float) -> str:
    return "+Inf" if b == float("inf") else repr(float(b))


def ready_from_snapshots(snapshots: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Ready workers per queue, from the workers' own snapshots."""
    ready: dict[str, int] = {}
    for snap in snapshots:
        if snap.get("state") == "ready":
            for queue in snap.get("queues", []):
                ready[queue] = ready.get(queue, 0) + 1
    return ready


def render_metrics(
    redis_client: Any | None,
    *,
    queue_depths: Callable[[], Mapping[str, int]] | None = None,
    workers_ready: Callable[[], Mapping[str, int]] | None = None,
    workers_unconsumed: Callable[[], Mapping[str, int]] | None = None,
    tenant_queues: Callable[[], Mapping[tuple[str, str], tuple[int, float]]] | None = None,
    multiproc_dir: Path | None = None,
    openmetrics: bool = False,
) -> tuple[bytes, str]:
    """The text exposition for ``/metrics``: this process's (or host's) in-process families
    plus the cluster-wide ones read from Redis. Returns (body, content type). ``openmetrics``:
    the OpenMetrics format (a scraper that asks for it: Prometheus with exemplar storage), the one
    that carries exemplars (the trace id of a request's latency observation)."""
    registry = CollectorRegistry(auto_describe=False)
    if multiproc_dir is not None and multiprocess_enabled():
        MultiProcessCollector(registry, path=str(multiproc_dir))
    else:
        registry.register(_ProcessFamilies())
    if redis_client is not None:
        registry.register(
            ClusterCollector(redis_client, queue_depths=queue_depths, workers_ready=workers_ready,
                             workers_unconsumed=workers_unconsumed, tenant_queues=tenant_queues)
        )
    if openmetrics:
        return openmetrics_latest(registry), OPENMETRICS_CONTENT_TYPE
    return generate_latest(registry), CONTENT_TYPE_LATEST


class _ProcessFamilies(Collector):
    """Re-exports the process registry inside a per-scrape registry."""

    def collect(self) -> Iterator[Metric]:
        yield from PROCESS_REGISTRY.collect()

    def describe(self) -> Iterable[Metric]:
        return []
