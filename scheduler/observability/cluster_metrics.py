"""``/metrics``' exposition: the collector of the cluster-wide families (workers' Redis records
and scrape-time gauges: queue depths, ready workers, beat leadership) merged with the process's
own families; readiness per queue from the workers' snapshots."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    generate_latest,
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

from scheduler.infra.redis_keys import (
    metrics_counter,
    metrics_histogram,
)
from scheduler.observability.metric_families import (
    FAMILIES,
    REDIS_COUNTERS,
    REDIS_HISTOGRAMS,
    _prom_name,
    version_label,
)
from scheduler.observability.metrics_recorder import (
    _decode,
    read_beat_leadership,
    read_worker_snapshots,
)
from scheduler.observability.process_metrics import PROCESS_REGISTRY, multiprocess_enabled

# ------------------------------------------------------------------------------------------
# Export: the collector that reads Redis (and the scrape-time gauges)
# ------------------------------------------------------------------------------------------

log = structlog.get_logger(__name__)


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
