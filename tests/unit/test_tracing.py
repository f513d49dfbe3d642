"""Tracing setup and helpers (scheduler/observability/tracing.py), without a collector.

Off means off (checked in a fresh interpreter: nothing of the SDK is imported or created); the
export queue is bounded and never blocks the caller, and every span it loses is counted; context
round-trips through message headers and the ids stored on a job; log lines carry the ids.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from scheduler.observability import tracing
from scheduler.observability.process_metrics import TRACE_SPANS_DROPPED

REPO_ROOT = Path(__file__).resolve().parents[2]

_OFF = """
import json, sys, threading
from opentelemetry import trace
from scheduler.infra.settings import Settings
from scheduler.observability import tracing
from api.app import create_app
import worker.job_runner, worker.tasks, scheduler.maintenance.beat  # every process's wiring
settings = Settings(data_dir=sys.argv[1])
create_app(settings)
on = tracing.setup_tracing(settings, process="worker")
with tracing.span("x") as s:
    pass
print(json.dumps({
    "on": on, "enabled": tracing.enabled(), "span": s is None,
    # redis-py imports opentelemetry.sdk.metrics when it is installed (its own observability);
    # the tracing SDK and the exporter are what tracing would load
    "sdk": sorted(m for m in sys.modules
                  if m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter"))),
    "provider": type(trace.get_tracer_provider()).__name__,
    "threads": [t.name for t in threading.enumerate() if "Otel" in t.name],
}))
"""


def test_off_creates_no_provider_processor_or_exporter(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _OFF, str(tmp_path)], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"on": False, "enabled": False, "span": True, "sdk": [], "provider": "ProxyTracerProvider",
                    "threads": []}


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process with an in-memory exporter (no global provider is replaced)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_provider", provider)
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer(tracing.TRACER_NAME))
    monkeypatch.setattr(tracing, "_enabled", True)
    yield exporter
    provider.shutdown()


def _dropped(reason: str) -> float:
    return TRACE_SPANS_DROPPED.labels(reason=reason)._value.get()


class _StuckExporter(SpanExporter):
    """A collector that never answers until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.release.wait(10)
        return SpanExportResult.SUCCESS


class _RefusingExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.FAILURE


def test_a_stuck_collector_never_blocks_and_the_lost_spans_are_counted() -> None:
    stuck = _StuckExporter()
    processor = tracing._bounded_processor(tracing._counting_exporter(stuck), queue_size=4)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    before = _dropped("queue_full")
    started = time.perf_counter()
    for _ in range(200):
        provider.get_tracer("t").start_span("s").end()
    elapsed = time.perf_counter() - started
    stuck.release.set()
    provider.shutdown()
    assert elapsed < 0.5  # 200 spans with the collector stuck: no waiting on it
    assert _dropped("queue_full") - before >= 200 - 4 - 4  # the queue, and the batch being exported


def test_a_refused_export_counts_its_spans() -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(tracing._counting_exporter(_RefusingExporter())))
    before = _dropped("export_failed")
    for _ in range(3):
        provider.get_tracer("t").start_span("s").end()
    assert _dropped("export_failed") - before == 3


def test_drops_reach_the_sink_from_the_export_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers and beat report drops to Redis through the sink (RedisMetricsRecorder), flushed
    after each export: a refused export's spans arrive there once, summed."""
    reported: list[tuple[str, int]] = []
    monkeypatch.setattr(tracing, "_drop_sink", lambda reason, count: reported.append((reason, count)))
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(tracing._counting_exporter(_RefusingExporter())))
    for _ in range(3):
        provider.get_tracer("t").start_span("s").end()
    assert reported == [("export_failed", 1)] * 3


def test_context_travels_in_headers_and_on_the_job_row(recorded: InMemorySpanExporter) -> None:
    headers: dict[str, object] = {}
    with tracing.tracer().start_as_current_span("submit") as submit:
        ids = tracing.recorded_ids()
        tracing.inject(headers)
    assert ids is not None and ids[0] == format(submit.get_span_context().trace_id, "032x")
    with tracing.job_span("run", tracing.extract(headers)) as run:
        assert run is not None
        with tracing.span("claim") as claim:
            assert claim is not None
    with tracing.job_span("republish", tracing.stored_parent(*ids)) as again:
        assert again is not None
    spans = {s.name: s for s in recorded.get_finished_spans()}
    assert {s.context.trace_id for s in spans.values()} == {submit.get_span_context().trace_id}
    assert spans["run"].parent.span_id == spans["submit"].context.span_id
    assert spans["claim"].parent.span_id == spans["run"].context.span_id
    assert spans["republish"].parent.span_id == spans["submit"].context.span_id


def test_untraced_work_starts_no_trace(recorded: InMemorySpanExporter) -> None:
    with tracing.job_span("run", None) as run, tracing.span("claim") as claim:
        assert run is None and claim is None
    assert tracing.stored_parent(None, None) is None and tracing.extract({}) is None
    assert tracing.stored_parent("zz", "1") is None
    assert recorded.get_finished_spans() == ()


def test_job_attributes_take_ids_and_counts_only() -> None:
    attrs = tracing.job_attributes(job_id="j", tenant="t", kind="generate", queue="interactive",
                                   model_version="v1", attempt=2)
    assert attrs == {"cloverq.job.id": "j", "cloverq.tenant": "t", "cloverq.job.kind": "generate",
                     "cloverq.queue": "interactive", "cloverq.model_version": "v1", "cloverq.job.attempt": 2}
    assert tracing.job_attributes(job_id=None) == {}


def test_log_lines_carry_trace_and_span_ids(recorded: InMemorySpanExporter) -> None:
    assert tracing.add_trace_ids(None, "info", {"event": "x"}) == {"event": "x"}
    with tracing.tracer().start_as_current_span("s") as s:
        line = tracing.add_trace_ids(None, "info", {"event": "x"})
    assert line["trace_id"] == format(s.get_span_context().trace_id, "032x")
    assert line["span_id"] == format(s.get_span_context().span_id, "016x")
    assert trace.get_current_span() is trace.INVALID_SPAN


_DEAD_COLLECTOR = """
import json, sys, time
from scheduler.infra.settings import Settings
from scheduler.observability import tracing
from scheduler.observability.process_metrics import TRACE_SPANS_DROPPED
assert tracing.setup_tracing(Settings(data_dir=sys.argv[1], tracing_enabled=True, tracing_queue_size=8),
                             process="api")
started = time.perf_counter()
for _ in range(500):
    with tracing.tracer().start_as_current_span("request"):
        pass
spent = time.perf_counter() - started
time.sleep(0.5)  # the export thread is now retrying against the dead collector
stopping = time.perf_counter()
tracing.shutdown_tracing()
print(json.dumps({"spans_s": spent, "shutdown_s": time.perf_counter() - stopping,
                  "queue_full": TRACE_SPANS_DROPPED.labels(reason="queue_full")._value.get()}))
"""


def test_a_dead_collector_slows_neither_requests_nor_the_exit(tmp_path: Path) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OTEL_BSP_SCHEDULE_DELAY": "50",
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed.getsockname()[1]}"}
    try:
        out = subprocess.run([sys.executable, "-c", _DEAD_COLLECTOR, str(tmp_path)], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=120, env=env)
    finally:
        closed.close()
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["spans_s"] < 0.5 and seen["queue_full"] >= 400
    assert seen["shutdown_s"] < tracing.SHUTDOWN_SECONDS + 1.5  # not the exporter's 10 s of retries
    assert "Queue full" not in out.stderr and "Transient error" not in out.stderr  # no log per span
