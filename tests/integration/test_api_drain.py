"""A draining API (``api/drain.py``) in process: not ready at once, a long poll already waiting
answers with the job's status by the drain's deadline (not at its own), and an event stream ends
there with the reconnect note. The same behaviour behind HAProxy, with real processes and SIGTERM,
is ``test_api_fleet.py``; this one runs without haproxy too."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from scheduler.infra.settings import Settings

pytestmark = pytest.mark.integration

DRAIN_SECONDS = 1.0
BODY = {"kind": "generate", "input": {"prompt": "Hello"}, "params": {"max_new_tokens": 8}}


@pytest.fixture
def client(make_settings: Callable[..., Settings], demo_checkpoint: Path) -> Iterator[TestClient]:
    settings = make_settings(model_dir=demo_checkpoint, auth="disabled", api_drain_seconds=DRAIN_SECONDS)
    with TestClient(create_app(settings)) as test_client:  # no worker: jobs stay queued
        yield test_client


def test_a_draining_replica_is_not_ready_and_ends_its_waits_by_the_deadline(client: TestClient) -> None:
    assert client.get("/readyz/replica").json()["ready"] is True
    job_id = client.post("/v1/jobs", json=BODY).json()["id"]
    answers: dict[str, tuple[int, str, float]] = {}

    def long_poll() -> None:
        started = time.monotonic()
        answer = client.get(f"/v1/jobs/{job_id}", params={"wait": 20})
        answers["poll"] = (answer.status_code, answer.json()["status"], time.monotonic() - started)

    poller = threading.Thread(target=long_poll)
    poller.start()
    time.sleep(0.3)  # waiting (a notice-less recheck would come only after 1 s)
    client.app.state.drain.begin()  # type: ignore[attr-defined]  # what SIGTERM does
    ready = client.get("/readyz/replica")
    assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
    assert ready.json()["checks"]["draining"]["ok"] is False
    assert client.get("/readyz").json()["checks"]["draining"]["ok"] is False
    with client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:  # opened while draining
        lines = list(stream.iter_lines())
    assert "event: status" in lines and not any(line == "event: result" for line in lines)
    assert [line for line in lines if line][-1] == ": replica stopping: reconnect with Last-Event-ID"
    poller.join(timeout=10)
    status, job_status, seconds = answers["poll"]
    assert (status, job_status) == (200, "queued")
    assert seconds < DRAIN_SECONDS + 3  # by the drain's deadline, not the 20 s wait
