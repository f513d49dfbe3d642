"""Tracing setup and helpers (scheduler/observability/tracing.py), without a collector.

Off means off (checked in a fresh interpreter: nothing of the SDK is imported or created); the
export queue is bounded and never blocks the caller, and every span it loses is counted; context
round-trips through message headers and the ids stored on a job; log lines carry the ids.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

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


def test_a_step_is_a_timed_event_of_the_current_span_or_a_child_span_when_asked(
        recorded: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch) -> None:
    """The submit's admission, SQL commit and publish: events on the request's span by default (a
    span each costs the submit path ~0.1 ms), child spans with ``tracing_step_spans``; a message
    published inside a step continues whichever is current; an error keeps only its type; nothing
    outside a recorded span."""
    with tracing.tracer().start_as_current_span("submit"):
        before = time.time_ns()
        with tracing.step("admission"):
            time.sleep(0.002)
        with pytest.raises(KeyError), tracing.step("commit"):
            raise KeyError("a prompt could be quoted here")
        event_headers: dict[str, object] = {}
        with tracing.step("publish", attributes={tracing.ATTR_QUEUE: "q"}):
            tracing.inject(event_headers)  # the message continues the request's span
    monkeypatch.setattr(tracing, "_step_spans", True)
    span_headers: dict[str, object] = {}
    with tracing.tracer().start_as_current_span("submit2"), tracing.step("admission") as child:
        assert child is not None
        tracing.inject(span_headers)  # the message continues the step's span
    with tracing.step("outside"):  # no current span
        pass
    spans = {s.name: s for s in recorded.get_finished_spans()}
    assert set(spans) == {"submit", "submit2", "admission"}

    def span_id(name: str) -> int:
        context = spans[name].context
        assert context is not None
        return context.span_id

    def parent_id(headers: dict[str, object]) -> int:
        return int(str(headers["traceparent"]).split("-")[2], 16)

    admission, commit, publish = ((e.name, dict(e.attributes or {})) for e in spans["submit"].events)
    assert spans["submit"].events[0].timestamp >= before
    assert admission[0] == "admission" and float(str(admission[1][tracing.ATTR_DURATION_MS])) >= 2.0
    assert commit == ("commit", {tracing.ATTR_DURATION_MS: commit[1][tracing.ATTR_DURATION_MS],
                                 "error.type": "KeyError"})
    assert publish[0] == "publish" and set(publish[1]) == {tracing.ATTR_DURATION_MS}  # the span has the rest
    assert parent_id(event_headers) == span_id("submit")
    assert parent_id(span_headers) == span_id("admission")
    parent = spans["admission"].parent
    assert parent is not None and parent.span_id == span_id("submit2")
    assert spans["submit2"].events == ()


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


def _serve_once(headers: list[tuple[bytes, bytes]], *, breaks: bool = False) -> list[tuple[bytes, bytes]]:
    """One request through the API's ObservabilityMiddleware over a bare app; the response headers.
    ``breaks``: the app raises after its 200 went out (a stream that breaks)."""
    from api.routes.metrics import ObservabilityMiddleware

    sent: list[dict[str, object]] = []

    async def app(scope: object, receive: object, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200 if breaks else 202, "headers": []})
        if breaks:
            raise RuntimeError(f"broken after {PROMPT_LIKE}")
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/jobs", "headers": headers}
    try:
        asyncio.run(ObservabilityMiddleware(app)(scope, receive, send))  # type: ignore[arg-type]
    except RuntimeError:
        assert breaks
    return list(sent[0]["headers"])  # type: ignore[call-overload]


PROMPT_LIKE = "a clause a client wrote"


def test_an_error_is_recorded_by_its_type_and_a_broken_stream_keeps_the_status_it_sent(
        recorded: InMemorySpanExporter) -> None:
    """The SDK's default would record the exception's message (a database error quotes the job's
    input); a stream that breaks after its 200 is a 200 on its span, as in the HTTP metric."""
    assert b"x-trace-id" in dict(_serve_once([], breaks=True))
    with pytest.raises(ValueError), tracing.tracer().start_as_current_span("job"), tracing.span("claim"):
        raise ValueError(PROMPT_LIKE)
    spans = {s.name: s for s in recorded.get_finished_spans()}
    request, claim = spans["POST unmatched"], spans["claim"]
    assert request.attributes is not None and request.attributes["http.response.status_code"] == 200
    for span, kind in ((request, "RuntimeError"), (claim, "ValueError")):
        assert span.attributes is not None and span.attributes["error.type"] == kind
        assert span.status.status_code == trace.StatusCode.ERROR and span.status.description == kind
        assert span.events == ()  # no exception event: its message and stack would quote input


def test_a_job_without_a_trace_does_not_join_the_current_one(recorded: InMemorySpanExporter) -> None:
    """Fair share releases held jobs inside other requests: an untraced one carries no
    ``traceparent`` and starts no child of the request's span; the request's span is current again
    after it."""
    headers: dict[str, object] = {}
    with tracing.tracer().start_as_current_span("request") as request:
        with tracing.job_span("republish", None) as republish:
            assert republish is None
            tracing.inject(headers)
            with tracing.span("claim") as claim:
                assert claim is None
        assert trace.get_current_span() is request
    assert headers == {}
    assert [s.name for s in recorded.get_finished_spans()] == ["request"]


_SETUP = """
import json, sys
from opentelemetry import trace
from scheduler.infra.settings import Settings
from scheduler.observability import tracing
settings = Settings(data_dir=sys.argv[1], tracing_enabled=True, tracing_sample_ratio=0.25)
tracing.setup_tracing(settings, process="api")
sampler = tracing._provider.sampler
seen = {"sampler": sampler.get_description(), "ratio": tracing._root_ratio}
tracing.shutdown_tracing(1.0)
seen["after"] = [tracing._root_ratio, tracing._step_spans, tracing.enabled()]
print(json.dumps(seen))
"""


def test_a_set_ratio_is_drawn_by_cloverq_and_the_sdk_follows_parents(tmp_path: Path) -> None:
    """With ``tracing_sample_ratio`` the SDK records every root it is asked for (sample_root drew it
    already) and follows a parent's flag; shutting tracing down forgets the ratio."""
    out = subprocess.run([sys.executable, "-c", _SETUP, str(tmp_path)], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                                      "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["sampler"].startswith("ParentBased{root:AlwaysOnSampler")
    assert seen["ratio"] == 0.25 and seen["after"] == [None, False, False]


def test_a_new_trace_is_drawn_before_any_span_and_a_clients_sampled_parent_is_followed(
        recorded: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tracing_sample_ratio`` is drawn by ``sample_root`` before a span is built: a sampled-out
    request builds none (no X-Trace-Id); a client's sampled ``traceparent`` is followed at any ratio."""
    monkeypatch.setattr(tracing, "_root_ratio", 0.25)
    monkeypatch.setattr(tracing, "random", random.Random(7))
    drawn = sum(tracing.sample_root() for _ in range(4000))
    assert 880 <= drawn <= 1120  # 1000 expected, standard deviation ~27
    monkeypatch.setattr(tracing, "_root_ratio", 0.0)
    assert not any(name == b"x-trace-id" for name, _ in _serve_once([]))
    assert recorded.get_finished_spans() == ()
    parent = f"00-{'ab' * 16}-{'cd' * 8}-01"
    answered = dict(_serve_once([(b"traceparent", parent.encode())]))
    assert answered[b"x-trace-id"] == b"ab" * 16
    (span,) = recorded.get_finished_spans()
    assert span.context is not None and format(span.context.trace_id, "032x") == "ab" * 16
    monkeypatch.setattr(tracing, "_root_ratio", 1.0)
    assert b"x-trace-id" in dict(_serve_once([]))
