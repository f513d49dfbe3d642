"""The official ``openai`` package, unchanged, against a running stack (API over HTTP, a real
worker on the tiny demo model, the session's database and Redis): chat, completions, streaming
(chunks arrive while the job still runs), models, errors, disconnects, and the Batch flow.

Every OpenAI call is a real cloverq job: the tests also read it back through ``/v1/jobs``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from scheduler.access.api_keys import create_key
from scheduler.infra.db import make_engine, session_factory
from scheduler.infra.queue_names import JOB_QUEUES
from scheduler.infra.settings import Settings
from tests.conftest import ProcessLauncher, clear_leftover_jobs, wait_for
from tests.integration.api_server import ApiServer

pytestmark = pytest.mark.integration

TENANT = "openai-tests"
QUICK = {"block_size": 4, "steps_per_block": 2}  # cloverq's knobs, as extra body fields
LONG = {"block_size": 32, "steps_per_block": 32}  # up to 2048 tokens, one pass each (EOS can end it)


@dataclass
class Stack:
    url: str
    key: str
    read_key: str
    other_key: str  # another tenant's
    admin_key: str  # drains queues (a job held queued)
    model: str
    settings: Settings

    def openai(self, *, base: str = "/v1", key: str | None = None, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60.0)
        return openai.OpenAI(base_url=self.url + base, api_key=key or self.key, **kwargs)

    def job(self, job_id: str) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {self.key}"})
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

    def jobs_with(self, label: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}/v1/jobs", params={"limit": 200},
                             headers={"Authorization": f"Bearer {self.key}"})
        response.raise_for_status()
        return [j for j in response.json()["items"] if (j.get("metadata") or {}).get("probe") == label]


@contextmanager
def running_stack(make_settings: Callable[..., Settings], checkpoint: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """API over HTTP + one worker on ``checkpoint``, with this module's keys (the tool tests run
    it on each demo family)."""
    settings = make_settings(model_dir=checkpoint, fault_injection=False)
    engine = make_engine(settings.resolved_database_url)
    with session_factory(engine)() as session:
        key = create_key(session, tenant=TENANT, scopes={"submit", "read"}, label="openai").key
        read_key = create_key(session, tenant=TENANT, scopes={"read"}, label="openai-read").key
        other_key = create_key(session, tenant="someone-else", scopes={"submit", "read"}, label="other").key
        admin_key = create_key(session, tenant="ops", scopes={"admin"}, label="openai-admin").key
    engine.dispose()
    clear_leftover_jobs(settings)  # the worker must see this module's jobs only
    launcher = ProcessLauncher(tmp_path_factory.mktemp("openai-stack"))
    server = ApiServer(settings).start()
    try:
        launcher.start_worker(settings)
        yield Stack(url=server.url, key=key, read_key=read_key, other_key=other_key, admin_key=admin_key,
                    model=checkpoint.name, settings=settings)
    finally:
        launcher.close()
        server.stop()


@pytest.fixture(scope="module")
def stack(make_settings: Callable[..., Settings], demo_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(make_settings, demo_checkpoint, tmp_path_factory) as running:
        yield running


def test_models_lists_the_served_model(stack: Stack) -> None:
    client = stack.openai()
    models = client.models.list()
    assert [m.id for m in models.data] == [stack.model]
    assert models.data[0].owned_by == "cloverq"
    assert client.models.retrieve(stack.model).id == stack.model
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found"


def test_chat_completion_is_a_real_job(stack: Stack) -> None:
    client = stack.openai()
    reply = client.chat.completions.create(
        model=stack.model, messages=[{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi there"}],
        max_tokens=16, temperature=0.7, top_p=0.9, seed=11, extra_body=QUICK,
        metadata={"probe": "chat"},
    )
    assert reply.object == "chat.completion"
    assert reply.model == stack.model
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 16
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    job = stack.job(reply.id.removeprefix("chatcmpl-"))  # the same job through cloverq's own API
    assert job["status"] == "succeeded" and job["tenant"] == TENANT and job["attempt"] == 1
    assert job["result"]["text"] == choice.message.content
    assert job["params"]["max_new_tokens"] == 16 and job["params"]["seed"] == 11
    assert job["params"]["block_size"] == 4 and job["params"]["steps_per_block"] == 2
    assert job["metadata"] == {"probe": "chat"}
    assert job["queue"] == "interactive"
    assert reply.system_fingerprint == job["model_version"]

    again = client.chat.completions.create(  # seeded: the same job again gives the same answer
        model=stack.model, messages=[{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi there"}],
        max_completion_tokens=16, temperature=0.7, top_p=0.9, seed=11, extra_body=QUICK,
    )
    assert again.choices[0].message.content == choice.message.content

    thinking = client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Think first"}], max_tokens=24,
        extra_body={**QUICK, "chat_template_kwargs": {"enable_thinking": True}, "step_budget": 64},
    )
    message = thinking.choices[0].message
    assert "reasoning_content" in (message.model_extra or {})  # thinking mode answers it (maybe empty)
    assert stack.job(thinking.id.removeprefix("chatcmpl-"))["params"]["thinking"] is True


def test_completions_with_stop_and_echo(stack: Stack) -> None:
    client = stack.openai()
    plain = client.completions.create(model=stack.model, prompt="Once upon a time", max_tokens=24,
                                      extra_body=QUICK)
    assert plain.object == "text_completion"
    text = plain.choices[0].text
    assert plain.usage is not None and plain.usage.completion_tokens > 0
    job = stack.job(plain.id.removeprefix("cmpl-"))
    assert job["result"]["text"] == text and job["params"]["max_new_tokens"] == 24

    if len(text) > 4:  # a stop sequence from the greedy answer cuts it there, finish_reason "stop"
        stop = text[2:4]
        cut = client.completions.create(model=stack.model, prompt="Once upon a time", max_tokens=24,
                                        stop=[stop], extra_body=QUICK)
        assert cut.choices[0].text == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
    echoed = client.completions.create(model=stack.model, prompt=["Once upon a time"], max_tokens=24,
                                       echo=True, extra_body=QUICK)
    assert echoed.choices[0].text == "Once upon a time" + text


def _timestamp(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(UTC).timestamp()


def test_chat_stream_sends_one_chunk_per_block_before_the_job_ends(stack: Stack) -> None:
    client = stack.openai()
    stream = client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Tell a long story"}], max_tokens=256,
        stream=True, stream_options={"include_usage": True},
        # Sampled (seeded): the job must outlast a few of the monitor's 0.1 s publishing ticks; greedy,
        # the random demo hit end-of-text after ~7 blocks, done in ~0.1 s, every chunk at the end.
        temperature=1.0, seed=7,
        extra_body={"block_size": 4, "steps_per_block": 4},
    )
    chunks: list[tuple[float, Any]] = [(time.time(), chunk) for chunk in stream]
    first = chunks[0][1]
    assert first.object == "chat.completion.chunk" and first.choices[0].delta.role == "assistant"
    job = stack.job(first.id.removeprefix("chatcmpl-"))
    assert job["status"] == "succeeded"
    content = [(t, c) for t, c in chunks[1:] if c.choices and c.choices[0].finish_reason is None]
    finish = [c for _, c in chunks if c.choices and c.choices[0].finish_reason is not None]
    usage = chunks[-1][1]
    assert usage.choices == [] and usage.usage is not None  # include_usage: the last chunk
    assert usage.usage.completion_tokens == job["result"]["usage"]["completion_tokens"]
    # one chunk per committed block (the answer's last piece may come with the final status)
    assert len(content) >= job["result"]["usage"]["blocks"] - 1 >= 2
    assert len(finish) == 1 and finish[0].choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].delta.content or "" for _, c in chunks if c.choices)
    assert streamed == job["result"]["text"]
    # chunks arrived while the job was still running, not all at its end
    finished_at = _timestamp(job["timings"]["finished_at"])
    assert content[0][0] < finished_at
    early = [t for t, _ in content if t < finished_at - 0.05]
    assert len(early) >= len(content) // 2, (len(early), len(content))


def test_completion_stream_and_stop(stack: Stack) -> None:
    client = stack.openai()
    pieces = [c.choices[0].text for c in client.completions.create(
        model=stack.model, prompt="Tell a long story", max_tokens=64, stream=True, extra_body=QUICK,
    ) if c.choices]
    full = client.completions.create(model=stack.model, prompt="Tell a long story", max_tokens=64,
                                     extra_body=QUICK).choices[0].text
    assert "".join(pieces) == full
    if len(full) > 8:
        stop = full[5:8]
        cut = [c for c in client.completions.create(
            model=stack.model, prompt="Tell a long story", max_tokens=64, stream=True, stop=stop,
            extra_body=QUICK) if c.choices]
        assert "".join(c.choices[0].text for c in cut) == full[: full.index(stop)]
        assert cut[-1].choices[0].finish_reason == "stop"


def test_errors_take_openais_shape(stack: Stack) -> None:
    client = stack.openai()
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.AuthenticationError) as bad_key:
        stack.openai(key="cq_nope_nope").chat.completions.create(model=stack.model, messages=messages)
    assert bad_key.value.code == "unauthorized" and bad_key.value.type == "authentication_error"

    with pytest.raises(openai.PermissionDeniedError) as read_only:
        stack.openai(key=stack.read_key).chat.completions.create(model=stack.model, messages=messages)
    assert read_only.value.code == "forbidden"

    cases: list[tuple[dict[str, Any], type[openai.APIStatusError], str, str | None]] = [
        ({"n": 2}, openai.BadRequestError, "unsupported_parameter", "n"),
        ({"model": "gpt-4o"}, openai.NotFoundError, "model_not_found", "model"),
        ({"max_tokens": 10**6}, openai.BadRequestError, "invalid_request", "max_tokens"),
        ({"messages": []}, openai.BadRequestError, "invalid_request", "messages"),
        ({"messages": [{"role": "function", "content": "x"}]}, openai.BadRequestError,
         "unsupported_parameter", "messages[0].role"),
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, openai.BadRequestError,
         "invalid_tool_name", "tools[0].function.name"),
        ({"extra_body": {"no_such_knob": 1}}, openai.BadRequestError, "unrecognized_argument",
         "no_such_knob"),
        ({"extra_body": {"steps_per_block": 8, "block_size": 4}}, openai.BadRequestError, "invalid_request",
         "steps_per_block"),
    ]
    for overrides, error, code, param in cases:
        body: dict[str, Any] = {"model": stack.model, "messages": messages, **overrides}
        with pytest.raises(error) as caught:
            client.chat.completions.create(**body)
        assert (caught.value.code, caught.value.param) == (code, param), (overrides, caught.value.body)
        assert isinstance(caught.value.body, dict)
        assert set(caught.value.body) == {"message", "type", "param", "code"}
        assert caught.value.message

    raw = httpx.post(f"{stack.url}/v1/chat/completions", content=b"{not json",
                     headers={"Authorization": f"Bearer {stack.key}", "Content-Type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    # cloverq's own routes keep their shape
    own = httpx.get(f"{stack.url}/v1/jobs/nope", headers={"Authorization": f"Bearer {stack.key}"})
    assert own.status_code == 404 and own.json()["error"]["code"] == "job_not_found"
    assert "details" in own.json()["error"]


def _cancelled(stack: Stack, label: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        jobs = stack.jobs_with(label)
        return jobs[0] if jobs and jobs[0]["status"] in ("cancelled", "succeeded", "failed") else None

    return dict(wait_for(done, timeout=30, interval=0.2, message=f"job {label} to stop"))


@contextmanager
def _queues_held(stack: Stack) -> Iterator[None]:
    """Every job queue drained (the worker acknowledges: it takes nothing), resumed on exit."""
    headers = {"Authorization": f"Bearer {stack.admin_key}"}
    try:
        for queue in JOB_QUEUES:
            drained = httpx.post(f"{stack.url}/v1/admin/queues/{queue}/drain", headers=headers)
            assert drained.status_code == 200 and drained.json()["nodes"], drained.text
        yield
    finally:
        for queue in JOB_QUEUES:
            httpx.post(f"{stack.url}/v1/admin/queues/{queue}/resume", headers=headers).raise_for_status()


def test_a_client_that_disconnects_cancels_its_job(stack: Stack) -> None:
    label = f"gone-{uuid.uuid4().hex[:8]}"
    # The demo may end at EOS long before 2,048 tokens (seen: 259 tokens in 1.75 s on a quiet
    # machine, and a faster one finishes inside the client's 0.5 s): the job is held queued, so
    # the disconnect, not the model, decides how it ends.
    with _queues_held(stack), pytest.raises(openai.APITimeoutError):
        stack.openai(timeout=0.5).chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "A very long story"}], max_tokens=2048,
            metadata={"probe": label}, extra_body=LONG)
    assert _cancelled(stack, label)["status"] == "cancelled"

    label = f"gone-stream-{uuid.uuid4().hex[:8]}"
    stream = stack.openai().chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "A very long story"}], max_tokens=2048,
        stream=True, metadata={"probe": label}, extra_body=LONG)
    next(iter(stream))  # the role chunk: the job exists and is followed
    stream.close()
    assert _cancelled(stack, label)["status"] == "cancelled"


def test_the_batch_flow(stack: Stack) -> None:
    client = stack.openai(base="/openai/v1")
    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": stack.model, "messages": [{"role": "user", "content": f"Question {i}"}],
                  "max_tokens": 8, **QUICK}}
        for i in range(3)
    ]
    upload = client.files.create(file=("requests.jsonl", "\n".join(json.dumps(x) for x in lines).encode()),
                                 purpose="batch")
    assert upload.purpose == "batch" and upload.bytes > 0 and upload.id.startswith("file-")
    assert client.files.retrieve(upload.id).filename == "requests.jsonl"
    assert upload.id in [f.id for f in client.files.list()]
    # /v1/files is the same store (a client on base_url /v1 can upload too)
    assert stack.openai().files.retrieve(upload.id).id == upload.id

    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "ci"})
    assert batch.status in ("in_progress", "completed") and batch.request_counts is not None
    assert batch.request_counts.total == 3 and batch.metadata == {"run": "ci"}
    cloverq_batch = (batch.model_extra or {})["cloverq_batch_id"]

    def finished() -> Any:
        current = client.batches.retrieve(batch.id)
        return current if current.status == "completed" else None

    done = wait_for(finished, timeout=60, interval=0.3, message="the batch to complete")
    assert done.request_counts.completed == 3 and done.request_counts.failed == 0
    assert done.output_file_id and done.error_file_id is None and done.completed_at
    output = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in output] == ["req-0", "req-1", "req-2"]
    for line in output:
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["body"]["object"] == "chat.completion"
        assert line["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    assert client.batches.list().data[0].id == batch.id
    stranger = stack.openai(base="/openai/v1", key=stack.other_key)  # tenancy: another tenant sees none
    for look in (lambda: stranger.batches.retrieve(batch.id), lambda: stranger.files.retrieve(upload.id),
                 lambda: stranger.files.content(done.output_file_id)):
        with pytest.raises(openai.NotFoundError):
            look()
    assert batch.id not in [b.id for b in stranger.batches.list().data]
    # the cloverq batch behind it, through cloverq's own API
    own = httpx.get(f"{stack.url}/v1/batches/{cloverq_batch}",
                    headers={"Authorization": f"Bearer {stack.key}"})
    assert own.json()["status"] == "completed" and own.json()["metadata"] == {"openai_batch_id": batch.id}
    late = client.batches.cancel(batch.id)  # finished: returned unchanged, as cloverq's batch is
    assert late.status == "completed" and late.cancelling_at is None and late.completed_at

    # cancel: queued jobs at once, the running ones within a pass; the rest lands in the error file
    slow = [{**line, "body": {**line["body"], "max_tokens": 2048, **LONG}} for line in lines]
    slow_file = client.files.create(file=("slow.jsonl", "\n".join(json.dumps(x) for x in slow).encode()),
                                    purpose="batch")
    slow_batch = client.batches.create(input_file_id=slow_file.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
    cancelling = client.batches.cancel(slow_batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at

    def cancelled() -> Any:
        current = client.batches.retrieve(slow_batch.id)
        return current if current.status == "cancelled" else None

    ended = wait_for(cancelled, timeout=30, interval=0.3, message="the batch to be cancelled")
    assert ended.request_counts.failed == 3 and ended.error_file_id
    errors = [json.loads(line) for line in client.files.content(ended.error_file_id).text.splitlines()]
    assert sorted(e["custom_id"] for e in errors) == ["req-0", "req-1", "req-2"]
    assert all(e["error"]["code"] == "job_cancelled" for e in errors)

    # a bad line refuses the whole batch, naming it; nothing is stored
    bad = client.files.create(file=("bad.jsonl", (json.dumps(lines[0]) + "\n{\"custom_id\": 1}\n").encode()),
                              purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert refused.value.code == "invalid_batch_input" and "line 2" in refused.value.message
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError) as wrong_purpose:
        client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
    assert wrong_purpose.value.param == "purpose"
