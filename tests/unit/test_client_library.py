"""The Python client without a server (httpx mock transports): retries on 429/503 honouring
``Retry-After``, idempotent submits, error mapping, SSE parsing and resuming, text assembly, the
extract helper."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from client import AsyncClient, Client, CloverqError, Job, JobEvent, RetryPolicy, TextAssembler, retry_after
from client._core import SSEParser, parse_lines

JOB = {"id": "j1", "kind": "generate", "status": "queued", "timings": {}}


def _sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr("client.sync.time.sleep", slept.append)
    return slept


def test_429_and_503_are_retried_after_retry_after_with_the_same_idempotency_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept = _sleeps(monkeypatch)
    answers = [httpx.Response(429, headers={"Retry-After": "2"}, json={"error": {"code": "queue_full",
                                                                               "message": "full"}}),
               httpx.Response(503, headers={"Retry-After": "0.5"}, json={"error": {"code": "unavailable",
                                                                                  "message": "db"}}),
               httpx.Response(202, json=JOB)]
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers.pop(0)

    with Client("http://api", "cq_k_s", transport=httpx.MockTransport(handler)) as cq:
        job = cq.submit("Hi", max_new_tokens=4)
    assert job.id == "j1" and slept == [2.0, 0.5]
    keys = {r.headers["Idempotency-Key"] for r in seen}
    assert len(seen) == 3 and len(keys) == 1  # one key: a retried submit cannot make two jobs
    assert seen[0].headers["Authorization"] == "Bearer cq_k_s"
    assert json.loads(seen[0].content) == {"kind": "generate", "input": {"prompt": "Hi"},
                                           "params": {"max_new_tokens": 4}}


def test_retries_end_with_the_error_and_other_errors_are_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    slept = _sleeps(monkeypatch)
    calls = []

    def busy(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(429, json={"error": {"code": "rate_limited", "message": "slow down",
                                                   "details": {"retry_after_seconds": 1}}})

    policy = RetryPolicy(max_retries=2, backoff=0.1)
    with Client("http://api", transport=httpx.MockTransport(busy), retry=policy) as cq, \
            pytest.raises(CloverqError) as caught:
        cq.get("j1")
    assert len(calls) == 3 and len(slept) == 2 and all(0.1 <= s <= 0.5 for s in slept)  # backoff
    assert (caught.value.status, caught.value.code) == (429, "rate_limited")

    def refused(request: httpx.Request) -> httpx.Response:
        return httpx.Response(422, json={"error": {"code": "invalid_request", "message": "no",
                                                   "details": [{"loc": ["body"]}]}})

    with Client("http://api", transport=httpx.MockTransport(refused)) as cq, \
            pytest.raises(CloverqError) as caught:
        cq.submit("x")
    assert caught.value.details == [{"loc": ["body"]}] and len(slept) == 2


def test_retry_after_reads_seconds_and_dates() -> None:
    assert retry_after(httpx.Response(429, headers={"Retry-After": "3"})) == 3.0
    assert retry_after(httpx.Response(429, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})) == 0.0
    assert retry_after(httpx.Response(429)) is None
    assert RetryPolicy(max_delay=5).delay(0, httpx.Response(429, headers={"Retry-After": "100"})) == 5


def test_the_async_client_retries_too(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr("client.aio.asyncio.sleep", fake_sleep)
    answers = [httpx.Response(503, headers={"Retry-After": "1"}),
               httpx.Response(200, json={**JOB, "status": "running"})]

    async def run() -> Any:
        async with AsyncClient("http://api", transport=httpx.MockTransport(lambda r: answers.pop(0))) as cq:
            return await cq.get("j1")

    assert asyncio.run(run()).status == "running" and slept == [1.0]


SSE = (
    "retry: 1000\n\n"
    'event: status\ndata: {"job_id": "j1", "status": "running", "attempt": 1}\n\n'
    ": keep-alive\n\n"
    'id: 1-0\nevent: progress\ndata: {"blocks_done": 1}\n\n'
    'id: 1-0\nevent: delta\ndata: {"attempt": 1, "offset": 0, "text": "Hel"}\n\n'
    'id: 2-0\nevent: delta\ndata: {"attempt": 1, "offset": 2, "text": "llo"}\n\n'
    'event: result\ndata: {"id": "j1", "kind": "generate", "status": "succeeded", '
    '"result": {"text": "Hello!"}, "timings": {}}\n\n'
)


def test_sse_parsing_and_text_assembly() -> None:
    events = parse_lines(SSE.split("\n"))
    assert [e.event for e in events] == ["status", "progress", "delta", "delta", "result"]
    assert events[1].id == "1-0" and events[2].text == "Hel"
    text = TextAssembler()
    assert [text.feed(e) for e in events] == ["", "", "Hel", "lo", "!"]
    assert events[-1].job is not None and events[-1].job.text == "Hello!"


def test_a_dropped_event_stream_resumes_after_the_last_event(monkeypatch: pytest.MonkeyPatch) -> None:
    _sleeps(monkeypatch)
    first = SSE.split('id: 2-0')[0]  # cut after the first delta
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Last-Event-ID"))
        if len(seen) == 1:
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=_Broken(first.encode()))
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=("id: 2-0" + SSE.split("id: 2-0")[1]).encode())

    with Client("http://api", transport=httpx.MockTransport(handler)) as cq:
        events = list(cq.stream("j1"))
    assert seen == [None, "1-0"]
    assert [e.event for e in events] == ["status", "progress", "delta", "delta", "result"]


class _Broken(httpx.SyncByteStream):
    """A body that breaks off after ``data`` (a dropped connection)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __iter__(self) -> Any:
        yield self.data
        raise httpx.RemoteProtocolError("peer closed connection")


def test_sse_parser_ignores_comments_and_keeps_the_last_id() -> None:
    parser = SSEParser()
    assert parser.feed(": hi") is None and parser.feed("id: 5-1") is None
    assert parser.feed("data: {\"a\": 1}") is None
    event = parser.feed("")
    assert isinstance(event, JobEvent) and event.event == "message" and event.data == {"a": 1}
    assert parser.last_id == "5-1"


def test_a_job_s_progress_carries_the_prompt_s_prefill() -> None:
    """``progress.prompt_tokens_done`` of ``progress.prompt_tokens`` (issue 33): 0 of N while a
    long prompt prefills, N once its first block is committed."""
    running = Job.model_validate({**JOB, "status": "running", "progress": {
        "prompt_tokens": 3000, "prompt_tokens_done": 0, "blocks_done": 0, "blocks_total": 6}})
    assert running.progress is not None
    assert (running.progress.prompt_tokens_done, running.progress.prompt_tokens) == (0, 3000)
    assert running.progress.prefilling
    first_block = running.progress.model_copy(update={"prompt_tokens_done": 3000, "blocks_done": 1})
    assert not first_block.prefilling
    older = Job.model_validate({**JOB, "progress": {"blocks_done": 0}})  # a server without the figures
    assert older.progress is not None and not older.progress.prefilling


def test_extract_sends_an_extract_body_and_the_value_reads_typed() -> None:
    sent: list[dict[str, Any]] = []
    done = {"id": "j2", "kind": "extract", "status": "succeeded", "timings": {},
            "result": {"text": '{"ok": true}', "data": {"ok": True}, "confidence": {"/ok": 0.75}}}

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(202, json=done)

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}

    async def run() -> Job:
        async with AsyncClient("http://api", transport=httpx.MockTransport(handler)) as cq:
            return await cq.extract("A document.", schema, seed=3)

    with Client("http://api", transport=httpx.MockTransport(handler)) as cq:
        job = cq.extract("A document.", schema, instructions="Is it ok?", params={"temperature": 0.5})
    assert asyncio.run(run()).data == {"ok": True}
    assert sent == [
        {"kind": "extract", "params": {"temperature": 0.5},
         "input": {"context": "A document.", "schema": schema, "instructions": "Is it ok?"}},
        {"kind": "extract", "input": {"context": "A document.", "schema": schema}, "params": {"seed": 3}},
    ]
    assert job.data == {"ok": True} and job.result is not None and job.result.confidence == {"/ok": 0.75}


def test_split_planes_send_admin_and_ops_calls_to_their_own_urls() -> None:
    """With the API's planes on their own ports, the overview goes to the admin URL and readiness
    to the ops URL; everything else stays on the public one (both clients)."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, json={"status": "ok"})

    planes = {"admin_url": "http://api:8001", "ops_url": "http://api:8002/"}
    with Client("http://api:8000", transport=httpx.MockTransport(handler), **planes) as cq:
        cq.overview()
        assert cq.ready()[0]

    async def run() -> None:
        async with AsyncClient("http://api:8000", transport=httpx.MockTransport(handler), **planes) as cq:
            await cq.overview()
            await cq.ready()

    asyncio.run(run())
    assert seen == ["http://api:8001/v1/admin/overview", "http://api:8002/readyz"] * 2
