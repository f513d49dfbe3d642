"""A running stack (API over HTTP, a real worker on the tiny demo model) seen through cloverq's
own surfaces: ``GET /v1/jobs/{id}/events`` (SSE), the Python client (``client/``, sync and
async), progress that never goes back, and the CLI commands built on the client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from client import AsyncClient, Client, CloverqError, JobEvent
from scheduler.access.api_keys import create_key
from scheduler.infra.db import make_engine, session_factory
from scheduler.infra.settings import Settings, get_settings
from tests.conftest import ProcessLauncher, clear_leftover_jobs
from tests.integration.api_server import ApiServer

pytestmark = pytest.mark.integration

TENANT = "client-tests"
QUICK = {"block_size": 4, "steps_per_block": 2}
STORY = {"max_new_tokens": 128, "block_size": 4, "steps_per_block": 4}  # ~30 blocks, ~1 s


@dataclass
class Stack:
    url: str
    key: str
    settings: Settings

    def client(self, **kwargs: Any) -> Client:
        return Client(self.url, self.key, **kwargs)


@pytest.fixture(scope="module")
def stack(make_settings: Callable[..., Settings], demo_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = make_settings(model_dir=demo_checkpoint, fault_injection=False)
    engine = make_engine(settings.resolved_database_url)
    with session_factory(engine)() as session:
        key = create_key(session, tenant=TENANT, scopes={"submit", "read"}, label="client").key
    engine.dispose()
    clear_leftover_jobs(settings)  # the worker must see this module's jobs only
    launcher = ProcessLauncher(tmp_path_factory.mktemp("client-stack"))
    server = ApiServer(settings).start()
    try:
        launcher.start_worker(settings)
        yield Stack(url=server.url, key=key, settings=settings)
    finally:
        launcher.close()
        server.stop()


def test_job_events_stream_status_progress_deltas_then_the_result(stack: Stack) -> None:
    with stack.client() as cq:
        job = cq.submit("Tell a long story", params=STORY, seed=5)
        events = list(cq.stream(job.id))
        final = cq.get(job.id)
    kinds = [e.event for e in events]
    assert kinds[0] == "status" and kinds[-1] == "result" and kinds.count("result") == 1
    statuses = [e.data["status"] for e in events if e.event == "status"]
    assert statuses[-1] == "succeeded" and set(statuses) <= {"queued", "running", "succeeded"}
    progress = [e.data for e in events if e.event == "progress"]
    blocks = [p["blocks_done"] for p in progress]
    assert blocks == sorted(set(blocks)) and len(blocks) >= 3  # one per committed block, in order
    assert all(p["blocks_total"] and p["blocks_done"] <= p["blocks_total"] for p in progress)
    assert blocks[-1] == final.result.usage["blocks"]
    text = ""
    for event in events:
        if event.event == "delta":
            text = text[: event.data["offset"]] + event.data["text"]
    result = events[-1].job
    assert result is not None and result.status == "succeeded"
    assert text == result.text == final.text
    assert all(e.id for e in events if e.event in ("progress", "delta"))

    # resume after an event: only what came later, then the result again (SQL's)
    middle = [e for e in events if e.event == "progress"][len(progress) // 2]
    with stack.client() as cq:
        resumed = list(cq.stream(job.id, after=middle.id))
    later = [e.data["blocks_done"] for e in resumed if e.event == "progress"]
    assert later and min(later) > middle.data["blocks_done"]
    assert resumed[-1].event == "result"

    # the wire format, as any SSE client sees it
    with httpx.stream("GET", f"{stack.url}/v1/jobs/{job.id}/events",
                      headers={"Authorization": f"Bearer {stack.key}"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.startswith("retry: 1000") and "\nevent: progress\n" in raw and "event: result\ndata: {" in raw


def test_events_of_missing_jobs_and_bad_resume_ids_are_4xx(stack: Stack) -> None:
    headers = {"Authorization": f"Bearer {stack.key}"}
    missing = httpx.get(f"{stack.url}/v1/jobs/00000000-0000-0000-0000-000000000000/events", headers=headers)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "job_not_found"
    with stack.client() as cq:
        job = cq.submit("Hi", params=QUICK, max_new_tokens=4)
    bad = httpx.get(f"{stack.url}/v1/jobs/{job.id}/events", params={"after": "soon"}, headers=headers)
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_request"
    assert httpx.get(f"{stack.url}/v1/jobs/{job.id}/events").status_code == 401


def test_progress_never_decreases_through_completion(stack: Stack) -> None:
    seen: list[dict[str, Any]] = []
    with stack.client() as cq:
        job = cq.submit("Tell a long story", params=STORY)
        while True:
            current = cq.get(job.id)
            if current.progress is not None:
                seen.append({"status": current.status, **current.progress.model_dump()})
            if current.is_final:
                break
            time.sleep(0.01)
    assert current.status == "succeeded"
    running = [p for p in seen if p["status"] == "running" and p["blocks_done"]]
    assert running, "the job was never seen running with progress"
    assert all(p["blocks_total"] for p in running)  # filled while it runs
    for name in ("blocks_done", "steps_used", "tokens_committed"):
        values = [p[name] or 0 for p in seen]
        assert values == sorted(values), (name, values)
    last = seen[-1]
    usage = current.result.usage
    assert (last["blocks_done"], last["steps_used"], last["tokens_committed"]) == (
        usage["blocks"], usage["steps_used"], usage["completion_tokens"])
    assert last["blocks_total"] == last["blocks_done"]  # finished: it needed exactly these
    fractions = [(p["blocks_done"] or 0) / p["blocks_total"] for p in seen if p["blocks_total"]]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0


def test_the_client_library_against_a_real_stack(stack: Stack) -> None:
    with stack.client() as cq:
        job = cq.submit(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=12, seed=1, **QUICK)
        assert job.status == "queued" and job.kind == "generate"
        done = cq.wait(job.id, timeout=60)
        assert done.status == "succeeded" and done.result is not None and done.result.token_ids
        assert done.progress is not None and done.progress.blocks_done == done.progress.blocks_total
        again = cq.submit(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=12, seed=1,
                          idempotency_key=f"same-{job.id}", **QUICK)
        assert cq.submit(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=12, seed=1,
                         idempotency_key=f"same-{job.id}", **QUICK).id == again.id

        pieces = list(cq.stream_text(cq.submit("Tell a long story", params=STORY).id))
        assert len(pieces) >= 3 and "".join(pieces)

        long = cq.submit("A very long story", max_new_tokens=2048, block_size=32, steps_per_block=32)
        cancelled = cq.cancel(long.id)
        assert cancelled.cancel_requested
        assert cq.wait(long.id, timeout=30).status == "cancelled"

        decision = cq.wait(cq.decide("The sky is blue today.", [
            {"id": "sky", "text": "What colour is the sky?", "choices": ["blue", "green"]},
            {"id": "day", "text": "Is it about today?"},
        ], params=QUICK).id, timeout=60)
        assert decision.status == "succeeded" and decision.result is not None
        answers = {a["id"]: a["choice"] for a in decision.result.answers or []}
        assert answers["sky"] in ("blue", "green") and answers["day"] in ("yes", "no")

        page = cq.list_jobs(kind="decide", limit=5)
        assert decision.id in [j.id for j in page.items]

        batch = cq.create_batch([{"kind": "generate", "input": {"prompt": f"Line {i}"},
                                  "params": {"max_new_tokens": 6, **QUICK}} for i in range(3)],
                                metadata={"via": "client"})
        assert batch.total == 3
        finished = cq.wait_batch(batch.id, timeout=60, poll_interval=0.2)
        assert finished.status == "completed" and finished.counts.get("succeeded") == 3
        results = list(cq.batch_results(batch.id))
        assert [r["index"] for r in results] == [0, 1, 2] and all(r["status"] == "succeeded" for r in results)

        with pytest.raises(CloverqError) as missing:
            cq.get("00000000-0000-0000-0000-000000000000")
        assert missing.value.status == 404 and missing.value.code == "job_not_found"
        with pytest.raises(CloverqError) as invalid:
            cq.submit("Hi", max_new_tokens=10**6)
        assert invalid.value.status == 422


def test_the_async_client(stack: Stack) -> None:
    async def run() -> tuple[list[str], Any, list[JobEvent]]:
        async with AsyncClient(stack.url, stack.key) as cq:
            job = await cq.submit("Tell a long story", params=STORY)
            pieces = [piece async for piece in cq.stream_text(job.id)]
            final = await cq.wait(job.id)
            events = [event async for event in cq.stream(job.id)]  # a final job: replayed, then result
            return pieces, final, events

    pieces, final, events = asyncio.run(run())
    assert final.status == "succeeded" and "".join(pieces) == final.text
    assert events[0].event == "status" and events[-1].event == "result"
    assert {e.event for e in events[1:-1]} <= {"progress", "delta"}


def _cli(stack: Stack, *args: str, input_text: str | None = None) -> Any:
    from cli.main import cli

    get_settings.cache_clear()  # the CLI reads CLOVERQ_API_URL / CLOVERQ_API_KEY through the settings
    try:
        result = CliRunner().invoke(cli, list(args), input=input_text,
                                    env={"CLOVERQ_API_URL": stack.url, "CLOVERQ_API_KEY": stack.key})
    finally:
        get_settings.cache_clear()
    return result


def test_cli_submit_decide_and_batch(stack: Stack, tmp_path: Path) -> None:
    waited = _cli(stack, "submit", "Hi there", "--max-new-tokens", "8", "--block-size", "4",
                  "--steps-per-block", "2", "--wait")
    assert waited.exit_code == 0, waited.output
    job = json.loads(waited.stdout[waited.stdout.index("{"):])
    assert job["status"] == "succeeded" and job["progress"]["blocks_total"] == job["progress"]["blocks_done"]

    streamed = _cli(stack, "submit", "Tell a long story", "--max-new-tokens", "64", "--block-size", "4",
                    "--steps-per-block", "2", "--stream")
    assert streamed.exit_code == 0, streamed.output

    decided = _cli(stack, "decide", "--context", "The sky is blue.", "--question", "sky=Is the sky blue?",
                   "--question", "Is it raining?", "--wait")
    assert decided.exit_code == 0, decided.output
    answers = json.loads(decided.stdout)["result"]["answers"]
    assert [a["id"] for a in answers] == ["sky", "q2"] and all(a["choice"] in ("yes", "no") for a in answers)

    specs = tmp_path / "jobs.jsonl"
    specs.write_text("\n".join(json.dumps({"kind": "generate", "input": {"prompt": f"P{i}"},
                                           "params": {"max_new_tokens": 4, **QUICK}}) for i in range(2)))
    submitted = _cli(stack, "batch", "submit", str(specs), "--wait", "--timeout", "60")
    assert submitted.exit_code == 0, submitted.output
    batch = json.loads(submitted.stdout)
    assert batch["status"] == "completed" and batch["total"] == 2
    status = _cli(stack, "batch", "status", batch["id"])
    assert json.loads(status.stdout)["counts"] == {"succeeded": 2}
    out = tmp_path / "results.jsonl"
    results = _cli(stack, "batch", "results", batch["id"], "-o", str(out))
    assert results.exit_code == 0, results.output
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 1]

    refused = _cli(stack, "submit", "Hi", "--max-new-tokens", "100000000")
    assert refused.exit_code == 1 and "invalid_request (HTTP 422)" in refused.output
    missing = _cli(stack, "batch", "status", "00000000-0000-0000-0000-000000000000")
    assert missing.exit_code == 1 and "batch_not_found (HTTP 404)" in missing.output


def test_cli_url_and_key_before_the_command_and_bad_json_given(stack: Stack, tmp_path: Path) -> None:
    """``cloverq --url URL --key KEY <command>`` wins over the environment; JSON typed wrong on the
    command line ends in one usage error naming the option (exit 2), never a traceback."""
    listed = _cli(stack, "--url", stack.url, "--key", stack.key, "jobs", "--limit", "1", "--json")
    assert listed.exit_code == 0, listed.output
    refused = _cli(stack, "--url", stack.url, "--key", "not-a-key", "jobs")
    assert refused.exit_code == 1 and "unauthorized (HTTP 401)" in refused.output
    assert "the key from --key" in refused.output
    away = _cli(stack, "--url", "http://127.0.0.1:1", "jobs")
    assert away.exit_code == 1 and "http://127.0.0.1:1 (from --url" in away.output
    top_away = _cli(stack, "--url", "http://127.0.0.1:1", "top", "--once")  # top reads them too
    assert top_away.exit_code == 1 and "http://127.0.0.1:1" in top_away.output, top_away.output

    lines = tmp_path / "jobs.jsonl"
    lines.write_text('{"kind": "generate", "input": {"prompt": "a"}}\n[1]\n')
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"kind": "generate", "input": {"prompt": "a"}}\nnope\n')
    good = tmp_path / "good.jsonl"
    good.write_text('{"kind": "generate", "input": {"prompt": "a"}}\n')
    for args, said in [
        (["submit", "--messages", "not json"], "--messages is not JSON: Expecting value (line 1, column 1)"),
        (["submit", "--messages", '{"role": "user"}'],
         "--messages must be a JSON list of {role, content}, not dict"),
        (["decide", "--context", "x", "--questions", "[1,"], "--questions is not JSON"),
        (["decide", "--context", "x", "--questions", f"@{tmp_path / 'none.json'}"],
         "--questions: cannot read"),
        (["decide", "--context", "x", "--question", "Is it?", "--mode", "joint", "--constraints", "{}"],
         "--constraints must be a JSON list"),
        (["batch", "submit", str(tmp_path / "none.jsonl")], "does not exist"),
        (["batch", "submit", str(lines), "--metadata", "{}"], f"{lines}, line 2 must be a JSON object"),
        (["batch", "submit", str(broken), "--metadata", "{}"],
         f"{broken}, line 2 is not JSON: Expecting value (column 1)"),
        (["batch", "submit", str(good), "--metadata", "[]"], "--metadata must be a JSON object, not list"),
    ]:
        result = _cli(stack, *args)
        assert result.exit_code == 2 and said in result.output, (args, result.output)
        assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
