"""The API with a real Celery worker on the tiny demo model: what a client sees end to end."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient

from api.app import create_app
from scheduler.infra.redis_keys import JOBS_FINISHED_CHANNEL
from scheduler.infra.settings import Settings

pytestmark = pytest.mark.integration


def _wait(client: TestClient, job_id: str, statuses: set[str], timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in statuses:
            return job
        time.sleep(0.05)
    pytest.fail(f"job {job_id} never reached {statuses}: {job}")


def _noticed(pubsub: Any, job_id: str, timeout: float = 10.0) -> bool:
    """Whether ``job_id`` is announced on the channel (other tests' leftover jobs may be too)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # get_message answers None for the skipped subscribe reply
        message = pubsub.get_message(timeout=0.5)
        if message is not None and message["data"].decode() == job_id:
            return True
    return False


def test_jobs_run_to_completion_and_cancel_through_the_api(
    test_settings: Settings, celery_worker_process: Callable[..., Any]
) -> None:
    settings = test_settings.replaced(auth="disabled")
    with TestClient(create_app(settings)) as client:
        celery_worker_process(settings)
        ready = client.get("/readyz")
        assert ready.status_code == 200, ready.text

        body = {"kind": "generate", "input": {"messages": [{"role": "user", "content": "Hi"}]},
                "params": {"max_new_tokens": 12, "block_size": 4, "steps_per_block": 2, "seed": 3}}
        notices = redis_lib.Redis.from_url(settings.resolved_redis_url).pubsub(ignore_subscribe_messages=True)
        notices.subscribe(JOBS_FINISHED_CHANNEL)
        job_id = client.post("/v1/jobs", json=body).json()["id"]
        job = client.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()  # long poll
        assert job["status"] == "succeeded", job
        assert _noticed(notices, job_id)  # the worker announced it to long-pollers
        notices.close()
        assert 0 < len(job["result"]["token_ids"]) <= 12
        assert job["result"]["usage"]["completion_tokens"] == len(job["result"]["token_ids"])
        assert job["attempt"] == 1
        assert job["model_version"]
        assert job["progress"]["steps_used"] >= 1
        timings = job["timings"]
        assert timings["started_at"] is not None and timings["finished_at"] is not None
        assert timings["engine_run_ms"] is not None and timings["engine_run_ms"] <= timings["total_ms"]

        long_body = {"kind": "generate", "input": {"prompt": "Tell a long story"},
                     "params": {"max_new_tokens": 2048, "steps_per_block": 32}}
        long_id = client.post("/v1/jobs", json=long_body).json()["id"]
        running = _wait(client, long_id, {"running"})  # one read: a second could find it already done
        assert running["status"] == "running"
        cancelled = client.post(f"/v1/jobs/{long_id}/cancel")
        assert cancelled.status_code == 200
        assert cancelled.json()["cancel_requested"] is True
        final = _wait(client, long_id, {"cancelled", "succeeded", "failed"}, timeout=30)
        assert final["status"] == "cancelled"
