"""The API process's own metrics (prometheus-client, in-process): submissions, HTTP traffic,
dropped spans, network refusals, and the multiprocess mode for several API processes on one host.
The families are named in ``metric_families.FAMILIES``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    values,
)

from scheduler.infra.settings import Settings
from scheduler.observability.metric_families import FAMILIES, _prom_name

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
