"""Webhooks end to end: a real worker runs the job, the light beat process delivers the signed
POST to an HTTP server started here; a failing endpoint is retried, then given up, and the
job's outcome is never touched."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from scheduler.infra.db import get_session_factory
from scheduler.infra.settings import Settings
from scheduler.webhooks.signing import SIGNATURE_HEADER, verify_signature
from scheduler.webhooks.tables import DeliveryStatus, WebhookDelivery
from tests.conftest import ProcessLauncher, wait_for
from tests.integration.webhook_receiver import WebhookReceiver

pytestmark = pytest.mark.integration

MAX_ATTEMPTS = 3


@pytest.fixture(scope="module")
def stack(
    make_settings: Callable[..., Settings], demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Settings, TestClient, WebhookReceiver]]:
    """API (in process) + one worker + the beat process, all on the test database and Redis."""
    settings = make_settings(
        model_dir=demo_checkpoint, auth="disabled", webhook_max_attempts=MAX_ATTEMPTS,
        webhook_backoff_base_seconds=0.2, webhook_backoff_max_seconds=0.5, webhook_timeout_seconds=2.0,
        webhook_sweep_interval_seconds=600.0,  # deliveries here come from the worker's hook
        # The receiver listens on loopback, which webhooks refuse unless allow-listed (SSRF).
        webhook_allowed_networks=["127.0.0.0/8"],
    )
    launcher = ProcessLauncher(tmp_path_factory.mktemp("webhook-logs"))
    receiver = WebhookReceiver().start()
    try:
        launcher.start_worker(settings)
        launcher.start_beat(settings)
        with TestClient(create_app(settings)) as client:
            yield settings, client, receiver
    finally:
        launcher.close()
        receiver.stop()


def _submit(client: TestClient, webhook_url: str) -> str:
    body = {"kind": "generate", "input": {"prompt": "Hello"}, "params": {"max_new_tokens": 8},
            "webhook_url": webhook_url, "metadata": {"order": 7}}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _finished(client: TestClient, job_id: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        job = client.get(f"/v1/jobs/{job_id}").json()
        return job if job["status"] not in ("queued", "running") else None

    return wait_for(done, timeout=60, interval=0.1, message=f"job {job_id} final")


def test_webhook_delivered_with_a_verifiable_signature(stack) -> None:  # type: ignore[no-untyped-def]
    _, client, receiver = stack
    path = f"/ok/{uuid.uuid4().hex}"
    job_id = _submit(client, receiver.url + path)
    job = _finished(client, job_id)
    assert job["status"] == "succeeded"

    posts = wait_for(lambda: receiver.on(path), timeout=30, message="webhook POST")
    post = posts[0]
    secret = client.get("/v1/webhooks/secret").json()["secret"]
    assert verify_signature(secret, post.headers[SIGNATURE_HEADER], post.body)
    assert not verify_signature(secret, post.headers[SIGNATURE_HEADER], post.body.replace(b"7", b"8"))
    payload = json.loads(post.body)
    assert payload["event"] == "job.finished"
    assert payload["job"]["id"] == job_id and payload["job"]["status"] == "succeeded"
    assert payload["job"]["metadata"] == {"order": 7}
    assert payload["job"]["result"]["text"] == job["result"]["text"]
    time.sleep(1.0)
    assert len(receiver.on(path)) == 1  # delivered exactly once


def test_failing_endpoint_retried_then_given_up_without_touching_the_job(stack) -> None:  # type: ignore[no-untyped-def]
    settings, client, receiver = stack
    path = f"/fail/{uuid.uuid4().hex}"
    job_id = _submit(client, receiver.url + path)
    job = _finished(client, job_id)
    assert job["status"] == "succeeded"

    sessions = get_session_factory(settings.resolved_database_url)

    def given_up() -> WebhookDelivery | None:
        with sessions() as session:
            row = session.query(WebhookDelivery).filter_by(job_id=uuid.UUID(job_id)).one_or_none()
            return row if row is not None and row.status == DeliveryStatus.GIVEN_UP.value else None

    delivery = wait_for(given_up, timeout=30, interval=0.1, message="delivery given up")
    assert delivery.attempts == MAX_ATTEMPTS and delivery.last_status_code == 500
    time.sleep(1.5)  # no attempt after giving up
    posts = receiver.on(path)
    assert len(posts) == MAX_ATTEMPTS
    gaps = [b.at - a.at for a, b in itertools.pairwise(posts)]
    assert all(gap >= 0.15 for gap in gaps), gaps  # backoff between attempts (base 0.2 s)
    after = client.get(f"/v1/jobs/{job_id}").json()
    assert after["status"] == "succeeded" and after["error"] is None
    assert after["result"] == job["result"] and after["attempt"] == job["attempt"]
