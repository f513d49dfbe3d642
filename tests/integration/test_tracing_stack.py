"""Tracing on a real stack (issue 29): the API over HTTP, a real Celery worker process and the beat
process on the demo model export OTLP/HTTP to this test's own receiver on loopback (a small HTTP
server decoding the protobuf with ``opentelemetry-proto``).

One generate job is ONE trace with spans from the API, the worker and beat (its webhook), parents
linked from the client's ``traceparent`` down to the outcome write and the webhook delivery, the
trace id returned on the job and in ``X-Trace-Id``, and no span attribute carrying the prompt or the
output; a job retried after a transient fault keeps its trace (the beat's republish and both
attempts are in it); a joint decision is one trace too, without its context or questions; a batch
is one trace with one publish span, the parent of each job's attempt.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from scheduler.access.api_keys import create_key
from scheduler.infra.db import make_engine, session_factory
from scheduler.infra.settings import Settings
from scheduler.observability import tracing
from tests.conftest import ProcessLauncher, clear_leftover_jobs, wait_for
from tests.integration.api_server import ApiServer
from tests.integration.webhook_receiver import WebhookReceiver

pytestmark = pytest.mark.integration

PROMPT = "tracing-probe: the secret prompt text"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    process: str  # the exporting process's cloverq.process resource attribute
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver:
    """An OTLP/HTTP traces endpoint on loopback: ``POST /v1/traces`` (protobuf, maybe gzip)."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(ReceivedSpan(
                        trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(), name=span.name,
                        process=str(resource.get(tracing.ATTR_PROCESS)),
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        events=[(e.name, {a.key: _value(a.value) for a in e.attributes})
                                for e in span.events],
                    ))
        with self.lock:
            self.spans.extend(found)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Stack:
    url: str
    key: str
    receiver: Receiver
    hooks: WebhookReceiver

    def submit(self, body: dict[str, Any], **headers: str) -> httpx.Response:
        response = httpx.post(f"{self.url}/v1/jobs", json=body,
                              headers={"Authorization": f"Bearer {self.key}", **headers}, timeout=30)
        assert response.status_code == 202, response.text
        return response

    def finished(self, job_id: str) -> dict[str, Any]:
        job: dict[str, Any] = httpx.get(f"{self.url}/v1/jobs/{job_id}", params={"wait": 25},
                                        headers={"Authorization": f"Bearer {self.key}"}, timeout=30).json()
        return job


@pytest.fixture(scope="module")
def stack(make_settings: Callable[..., Settings], demo_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    receiver = Receiver()
    patch = pytest.MonkeyPatch()
    # Read by the exporter (this process's API, and the worker and beat, which inherit os.environ).
    patch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s (default 5 s)
    patch.delenv("OTEL_SERVICE_NAME", raising=False)
    settings = make_settings(model_dir=demo_checkpoint, tracing_enabled=True, tracing_sample_ratio=1.0,
                             webhook_allowed_networks=["127.0.0.0/8"])  # the webhook receiver on loopback
    hooks = WebhookReceiver().start()
    engine = make_engine(settings.resolved_database_url)
    with session_factory(engine)() as session:
        key = create_key(session, tenant="tracing-tests", scopes={"submit", "read"}, label="tracing").key
    engine.dispose()
    clear_leftover_jobs(settings)
    launcher = ProcessLauncher(tmp_path_factory.mktemp("tracing-stack"))
    server = ApiServer(settings).start()
    try:
        launcher.start_worker(settings, queues="interactive,standard,bulk,joint")
        launcher.start_beat(settings)  # republishes a retried job
        yield Stack(url=server.url, key=key, receiver=receiver, hooks=hooks)
    finally:
        launcher.close()
        hooks.stop()
        server.stop()
        tracing.shutdown_tracing()  # this process's API: nothing recorded after this module
        patch.undo()
        receiver.close()


def _wait_spans(stack: Stack, trace_id: str,
                needed: Callable[[list[ReceivedSpan]], bool]) -> list[ReceivedSpan]:
    def ready() -> list[ReceivedSpan] | None:
        spans = stack.receiver.trace(trace_id)
        return spans if needed(spans) else None

    spans: list[ReceivedSpan] = wait_for(ready, timeout=20, interval=0.1, message="spans of the job's trace")
    return spans


def _succeeded_runs(spans: list[ReceivedSpan]) -> int:
    """Attempts that finished their job (the worker's last span of a job: it ends after the
    outcome write, and may reach the receiver in a later export)."""
    return sum(s.name == "cloverq.run_job" and s.attributes.get("cloverq.run_outcome") == "succeeded"
               for s in spans)


def _generate(seed: int, **params: Any) -> dict[str, Any]:
    return {"kind": "generate", "input": {"messages": [{"role": "user", "content": PROMPT}]},
            "params": {"max_new_tokens": 8, "block_size": 4, "steps_per_block": 2, "seed": seed, **params}}


def _no_text(spans: list[ReceivedSpan], texts: list[str]) -> None:
    for span in spans:
        values = [*span.attributes.values(), *(v for _, attrs in span.events for v in attrs.values())]
        for value in values:
            for text in texts:
                assert not (isinstance(value, str) and text and text in value), (span.name, value)


def test_one_generate_job_is_one_trace_across_api_worker_and_beat(stack: Stack) -> None:
    body = {**_generate(1), "webhook_url": f"{stack.hooks.url}/done"}
    response = stack.submit(body, traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
    job_id = response.json()["id"]
    assert response.headers["X-Trace-Id"] == CLIENT_TRACE  # the client's trace is continued
    job = stack.finished(job_id)
    assert job["status"] == "succeeded", job
    assert job["trace_id"] == CLIENT_TRACE

    wanted = {"POST /v1/jobs", "cloverq.webhook.deliver"}
    spans = _wait_spans(stack, CLIENT_TRACE,
                        lambda s: wanted <= {x.name for x in s} and _succeeded_runs(s) == 1)
    by_name = {s.name: s for s in spans}
    submit, run = by_name["POST /v1/jobs"], by_name["cloverq.run_job"]  # the request's span is the submit's
    assert submit.parent_id == CLIENT_SPAN and submit.process == "api"
    assert submit.attributes[tracing.ATTR_JOB_ID] == job_id
    assert submit.attributes["http.response.status_code"] == 202
    steps = dict(submit.events)  # the steps inside the request: timed events (tracing.step)
    for name in ("cloverq.admission", "cloverq.sql.insert_commit", "cloverq.publish"):
        assert name not in by_name and steps[name][tracing.ATTR_DURATION_MS] > 0
    assert submit.attributes[tracing.ATTR_QUEUE] == job["queue"]
    assert run.parent_id == submit.span_id and run.process == "worker"  # the message's traceparent
    for name in ("cloverq.claim", "cloverq.engine", "cloverq.outcome_write"):
        assert by_name[name].parent_id == run.span_id and by_name[name].process == "worker"
    assert by_name["cloverq.engine.queue_wait"].parent_id == by_name["cloverq.engine"].span_id
    hook = by_name["cloverq.webhook.deliver"]  # on beat, after the worker recorded the delivery
    assert hook.parent_id == run.span_id and hook.process == "beat"
    assert hook.attributes["cloverq.webhook.status"] == "delivered"
    assert stack.hooks.on("/done")
    blocks = [attrs for name, attrs in by_name["cloverq.engine"].events if name == "block.committed"]
    assert blocks and blocks[-1]["cloverq.tokens"] > 0 and blocks[-1]["cloverq.passes"] > 0
    assert {s.process for s in spans} == {"api", "worker", "beat"}
    assert run.attributes[tracing.ATTR_JOB_ID] == job_id
    assert run.attributes[tracing.ATTR_TENANT] == "tracing-tests"
    assert run.attributes[tracing.ATTR_KIND] == "generate" and run.attributes[tracing.ATTR_ATTEMPT] == 1
    assert run.attributes[tracing.ATTR_MODEL_VERSION] == job["model_version"]
    _no_text(spans, [PROMPT, job["result"]["text"]])
    # The submit's latency observation keeps its trace id as the bucket's exemplar (OpenMetrics).
    metrics = httpx.get(f"{stack.url}/metrics", headers={"Accept": "application/openmetrics-text"})
    assert metrics.headers["content-type"].startswith("application/openmetrics-text")
    assert any(line.startswith("cloverq_http_request_seconds_bucket") and 'route="/v1/jobs"' in line
               and f'# {{trace_id="{CLIENT_TRACE}"}}' in line for line in metrics.text.splitlines())


def test_a_retried_job_keeps_its_trace(stack: Stack) -> None:
    response = stack.submit(_generate(2, fault="transient_once"))  # no traceparent: a new trace
    trace_id = response.headers["X-Trace-Id"]
    assert len(trace_id) == 32 and trace_id != CLIENT_TRACE
    job = stack.finished(response.json()["id"])
    assert job["status"] == "succeeded" and job["attempt"] == 2, job
    assert job["trace_id"] == trace_id

    def both_attempts(spans: list[ReceivedSpan]) -> bool:
        return _succeeded_runs(spans) == 1 and len([s for s in spans if s.name == "cloverq.run_job"]) == 2

    spans = _wait_spans(stack, trace_id, both_attempts)
    by_id = {s.span_id: s for s in spans}
    submit = next(s for s in spans if s.name == "POST /v1/jobs")
    runs = sorted((s for s in spans if s.name == "cloverq.run_job"),
                  key=lambda s: s.attributes[tracing.ATTR_ATTEMPT])
    assert [r.attributes[tracing.ATTR_ATTEMPT] for r in runs] == [1, 2]
    assert runs[0].parent_id == submit.span_id
    retry = next(s for s in spans if s.name == "cloverq.retry_or_fail")
    assert retry.parent_id == runs[0].span_id and retry.attributes["cloverq.next_status"] == "queued"
    republish = by_id[runs[1].parent_id]  # the beat's reconciler, parented to the stored submit span
    assert republish.name == "cloverq.republish" and republish.process == "beat"
    assert republish.parent_id == submit.span_id
    assert {s.process for s in spans} == {"api", "worker", "beat"}
    _no_text(spans, [PROMPT, job["result"]["text"]])


CONTEXT = "tracing-probe context: the supplier may terminate with 30 days written notice."
QUESTION = "tracing-probe question: may the supplier terminate early?"


def test_a_joint_decision_is_one_trace(stack: Stack) -> None:
    body = {"kind": "decide", "params": {"seed": 3},
            "input": {"context": CONTEXT, "mode": "joint", "questions": [
                {"id": "terminate", "text": QUESTION},
                {"id": "notice", "text": "Is written notice required?", "choices": ["yes", "no"]}]}}
    response = stack.submit(body)
    trace_id = response.headers["X-Trace-Id"]
    job = stack.finished(response.json()["id"])
    assert job["status"] == "succeeded" and job["queue"] == "joint", job
    assert job["trace_id"] == trace_id
    spans = _wait_spans(stack, trace_id, lambda s: _succeeded_runs(s) == 1)
    by_name = {s.name: s for s in spans}
    by_id = {s.span_id: s for s in spans}
    run = next(s for s in spans if s.name == "cloverq.run_job"
               and s.attributes.get("cloverq.run_outcome") == "succeeded")
    # the joint gate may hand a message back (its run_job ends handed_back): the beat republishes it
    submit = by_name["POST /v1/jobs"]
    assert run.parent_id == submit.span_id or (by_id[run.parent_id].name == "cloverq.republish"
                                               and by_id[run.parent_id].parent_id == submit.span_id)
    assert run.attributes[tracing.ATTR_KIND] == "decide" and run.attributes[tracing.ATTR_QUEUE] == "joint"
    assert by_name["cloverq.engine"].parent_id == run.span_id
    assert {s.process for s in spans} == {"api", "worker"}
    _no_text(spans, [CONTEXT, QUESTION])


def test_a_batch_is_one_trace_with_one_publish_span(stack: Stack) -> None:
    auth = {"Authorization": f"Bearer {stack.key}"}
    specs = [{**_generate(10 + i), "metadata": {"probe": "batch-trace"}} for i in range(2)]
    response = httpx.post(f"{stack.url}/v1/batches", json={"jobs": specs}, headers=auth, timeout=30)
    assert response.status_code == 202, response.text
    trace_id = response.headers["X-Trace-Id"]

    def finished() -> list[dict[str, Any]] | None:
        items = httpx.get(f"{stack.url}/v1/jobs", params={"limit": 50}, headers=auth).json()["items"]
        mine = [j for j in items if (j.get("metadata") or {}).get("probe") == "batch-trace"]
        return mine if len(mine) == 2 and all(j["status"] == "succeeded" for j in mine) else None

    jobs: list[dict[str, Any]] = wait_for(finished, timeout=30, interval=0.2, message="the batch's jobs")
    assert {j["trace_id"] for j in jobs} == {trace_id}
    spans = _wait_spans(stack, trace_id, lambda s: _succeeded_runs(s) == 2)
    by_name = {s.name: s for s in spans}
    publish = by_name["cloverq.batch.publish"]
    assert publish.parent_id == by_name["POST /v1/batches"].span_id
    assert publish.attributes["cloverq.batch.jobs"] == 2
    assert [s.name for s in spans].count("cloverq.batch.publish") == 1
    runs = [s for s in spans
            if s.name == "cloverq.run_job" and s.attributes["cloverq.run_outcome"] == "succeeded"]
    # Fair share (on by default) holds a batch's jobs and releases them one by one: each message
    # carries a republish span of its own, in the job's trace under the request's span
    # (scheduler/fairness/release.py, as the reconciler's republishing does).
    job_publishes = {s.span_id: s for s in spans if s.name == "cloverq.republish"}
    assert len(runs) == 2 and all(
        job_publishes[r.parent_id].attributes[tracing.ATTR_JOB_ID] == r.attributes[tracing.ATTR_JOB_ID]
        and job_publishes[r.parent_id].parent_id == by_name["POST /v1/batches"].span_id for r in runs)
    assert {r.attributes[tracing.ATTR_JOB_ID] for r in runs} == {j["id"] for j in jobs}
    _no_text(spans, [PROMPT])
