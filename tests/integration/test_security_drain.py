"""Admin drain / resume with a REAL Celery worker on the tiny demo model.

One worker start covers both paths: a queue drained *before* the worker starts is never
consumed by it (the worker honours the Redis flag at start), and a queue drained *while* it
runs stops being consumed at once (remote-control broadcast); resuming runs the held jobs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient

from api.app import create_app
from scheduler.access.api_keys import create_key
from scheduler.fleet.operator_state import clear_operator_state
from scheduler.infra.db import make_engine, session_factory
from scheduler.infra.settings import Settings
from tests.conftest import ProcessLauncher, wait_for

pytestmark = pytest.mark.integration

JOB = {"kind": "generate", "input": {"prompt": "Clause 1:"}, "params": {"max_new_tokens": 4}}


@pytest.fixture
def admin_client(test_settings: Settings, redis_url: str) -> Iterator[tuple[TestClient, dict[str, str]]]:
    sessions = session_factory(make_engine(test_settings.resolved_database_url))
    with sessions() as session:
        key = create_key(session, tenant="ops", scopes=["admin"]).key
    with TestClient(create_app(test_settings)) as client:
        yield client, {"Authorization": f"Bearer {key}"}
    with sessions() as session:  # SQL too: a later API start would restore a leftover drain
        clear_operator_state(session, redis_lib.Redis.from_url(redis_url))


def status_of(client: TestClient, headers: dict[str, str], job_id: str) -> str:
    return str(client.get(f"/v1/jobs/{job_id}", headers=headers).json()["status"])


def submit(client: TestClient, headers: dict[str, str]) -> str:
    response = client.post("/v1/jobs", json=JOB, headers=headers)
    assert response.status_code == 202 and response.json()["queue"] == "interactive", response.text
    return str(response.json()["id"])


def test_drain_holds_jobs_and_resume_runs_them(
    admin_client: tuple[TestClient, dict[str, str]], launcher: ProcessLauncher, test_settings: Settings
) -> None:
    client, headers = admin_client
    drained = client.post("/v1/admin/queues/interactive/drain", headers=headers)
    assert drained.status_code == 200 and drained.json() == {
        "queue": "interactive",
        "drained": True,
        "nodes": [],
    }

    worker = launcher.start_worker(test_settings)  # starts while "interactive" is drained
    workers = client.get("/v1/admin/workers", headers=headers).json()
    [info] = [w for w in workers["items"] if w["pid"] == worker.pid]
    assert info["state"] == "ready" and info["model_version"] and "interactive" in info["queues"]
    assert workers["drained_queues"] == ["interactive"]

    held = submit(client, headers)
    time.sleep(3.0)
    assert status_of(client, headers, held) == "queued"

    resumed = client.post("/v1/admin/queues/interactive/resume", headers=headers)
    assert resumed.status_code == 200 and resumed.json()["nodes"] == [worker.worker_id]
    wait_for(
        lambda: status_of(client, headers, held) == "succeeded",
        timeout=90,
        interval=0.2,
        message="the held job to run after resume",
    )

    # Drain while the worker runs: the broadcast reaches it and it acknowledges.
    again = client.post("/v1/admin/queues/interactive/drain", headers=headers)
    assert again.json()["nodes"] == [worker.worker_id]
    held_again = submit(client, headers)
    time.sleep(3.0)
    assert status_of(client, headers, held_again) == "queued"
    queues: Any = client.get("/v1/admin/queues", headers=headers).json()["items"]
    assert next(q for q in queues if q["name"] == "interactive")["drained"] is True
    client.post("/v1/admin/queues/interactive/resume", headers=headers)
    wait_for(
        lambda: status_of(client, headers, held_again) == "succeeded",
        timeout=90,
        interval=0.2,
        message="the second held job to run after resume",
    )
