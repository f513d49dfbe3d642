"""Prometheus metrics of cloverq: the family names (the one registry), who records what, and how
it is exported.

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

from dataclasses import dataclass
from typing import Literal

from prometheus_client import (
    disable_created_metrics,
)

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


def process_version() -> tuple[str, str] | None:
    """The (version, track) this worker process serves now (``set_process_version``)."""
    return _process_version


def version_label(model_version: str | None) -> str | None:
    """The version name of a worker's ``<version>@<manifest digest>`` label."""
    return model_version.split("@", 1)[0] if model_version else None


def _prom_name(name: str) -> str:
    """prometheus-client wants counter names without the ``_total`` suffix."""
    return name.removesuffix("_total")
