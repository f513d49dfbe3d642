"""The deltas of ``GET /v1/jobs/{id}/events`` always add up to the job's stored text (issue 31).

A second API replica's reader could miss the last blocks: the job became final in SQL between
its last ``XREAD`` and the next, and the result was sent without the stream entries still unread;
and the worker's last bytes (an incomplete UTF-8 sequence, stored as U+FFFD) reach only SQL. Here
the stream of a finished job carries part of its text only (as a lagging or lossy stream does):
the reader must be sent the rest before the result, both for a job that was running when it
started reading and for one already final.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient
from sqlalchemy import update

from api.app import create_app
from scheduler.infra.db import get_session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs import event_stream as job_stream
from scheduler.jobs.finished_notice import publish_finished
from scheduler.jobs.models import Job, JobStatus, utcnow

pytestmark = pytest.mark.integration

STORED = "Notice of twelve days\ufffd"  # ends as a worker's held-back bytes are stored
STREAMED = [(0, "Notice "), (7, "of twelve")]  # (offset, delta) of the blocks the stream carries


@pytest.fixture
def client(test_settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(test_settings.replaced(auth="disabled"))) as client:
        yield client


def _submit(client: TestClient) -> str:
    response = client.post("/v1/jobs", json={"kind": "generate", "input": {"prompt": "Notice?"}})
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _write_blocks(redis_url: str, job_id: str) -> None:
    client = redis_lib.Redis.from_url(redis_url)
    events = [job_stream.status_event("running", 1)]
    events += [{"type": "block", "attempt": 1, "offset": offset, "delta": delta, "blocks_done": i + 1}
               for i, (offset, delta) in enumerate(STREAMED)]  # fmt: skip
    with client.pipeline() as pipe:
        job_stream.add_events(pipe, job_id, events)
        pipe.execute()


def _finish(settings: Settings, job_id: str, *, running_first: bool = False) -> None:
    sessions = get_session_factory(settings.resolved_database_url)
    with sessions() as session:
        if running_first:
            session.execute(update(Job).where(Job.id == uuid.UUID(job_id))
                            .values(status=JobStatus.RUNNING.value, attempt=1, started_at=utcnow()))
        else:
            session.execute(update(Job).where(Job.id == uuid.UUID(job_id)).values(
                status=JobStatus.SUCCEEDED.value, attempt=1, finished_at=utcnow(),
                result={"text": STORED, "finish_reason": "eos", "token_ids": [1, 2, 3]}))
        session.commit()


def _deltas_add_up(body: str) -> tuple[str, dict[str, Any]]:
    text, result = "", {}
    for chunk in body.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines() if ": " in line)
        if lines.get("event") == "delta":
            data = json.loads(lines["data"])
            text = text[: data["offset"]] + data["text"]
        elif lines.get("event") == "result":
            result = json.loads(lines["data"])
    return text, result


def test_a_finished_jobs_stream_is_completed_from_the_stored_text(
    client: TestClient, test_settings: Settings, redis_url: str
) -> None:
    job_id = _submit(client)
    _write_blocks(redis_url, job_id)
    _finish(test_settings, job_id)
    body = client.get(f"/v1/jobs/{job_id}/events").text
    text, result = _deltas_add_up(body)
    assert result["status"] == "succeeded" and result["result"]["text"] == STORED
    assert text == STORED


def test_a_job_that_ends_while_followed_is_completed_too(
    client: TestClient, test_settings: Settings, redis_url: str
) -> None:
    job_id = _submit(client)
    _finish(test_settings, job_id, running_first=True)

    def end_it() -> None:  # the worker: blocks to the stream, the outcome to SQL, then the notice
        time.sleep(0.5)
        _write_blocks(redis_url, job_id)
        _finish(test_settings, job_id)
        publish_finished(redis_lib.Redis.from_url(redis_url), job_id)

    ender = threading.Thread(target=end_it)
    ender.start()
    body = client.get(f"/v1/jobs/{job_id}/events").text
    ender.join(10)
    text, result = _deltas_add_up(body)
    assert result["status"] == "succeeded"
    assert text == STORED
