"""A batch of 1,000 decisions through a real worker, results streamed in submission order;
the batch's webhook fires once when it is complete; the sweeper notifies jobs that finished
without a worker (cancelled while queued)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from scheduler.infra.settings import Settings
from scheduler.webhooks.signing import SIGNATURE_HEADER, verify_signature
from tests.conftest import ProcessLauncher, wait_for
from tests.integration.webhook_receiver import WebhookReceiver

pytestmark = pytest.mark.integration

BATCH_SIZE = 1000


@pytest.fixture(scope="module")
def stack(
    make_settings: Callable[..., Settings], demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Settings, TestClient, WebhookReceiver]]:
    settings = make_settings(model_dir=demo_checkpoint, auth="disabled", engine_max_batch=16,
                             batch_max_jobs=BATCH_SIZE, webhook_sweep_interval_seconds=0.5,
                             tenant_max_active_jobs=10 * BATCH_SIZE,  # other modules leave queued jobs
                             webhook_allowed_networks=["127.0.0.0/8"],  # the loopback receiver (SSRF)
                             log_level="WARNING")
    launcher = ProcessLauncher(tmp_path_factory.mktemp("batch-logs"))
    receiver = WebhookReceiver().start()
    try:
        launcher.start_worker(settings, queues="interactive,standard,bulk", concurrency=16)
        launcher.start_beat(settings)
        with TestClient(create_app(settings)) as client:
            yield settings, client, receiver
    finally:
        launcher.close()
        receiver.stop()


def _spec(i: int) -> dict:
    return {
        "kind": "decide",
        "metadata": {"row": i},
        "input": {
            "context": f"Contract {i}: the supplier may terminate with {i % 90 + 1} days notice.",
            "questions": [
                {"id": "terminate", "text": "May the supplier terminate?"},
            ],
        },
        "params": {"steps_per_block": 1, "seed": i},
    }


def test_batch_of_1000_decisions_completes_with_results_in_order(stack) -> None:  # type: ignore[no-untyped-def]
    _, client, receiver = stack
    hook = f"/batch/{uuid.uuid4().hex}"
    began = time.monotonic()
    response = client.post("/v1/batches", json={"jobs": [_spec(i) for i in range(BATCH_SIZE)],
                                                "webhook_url": receiver.url + hook})
    assert response.status_code == 202, response.text
    batch_id = response.json()["id"]
    stored = time.monotonic() - began

    def complete() -> dict | None:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        return batch if batch["status"] == "completed" else None

    batch = wait_for(complete, timeout=240, interval=0.5, message="batch complete")
    ran = time.monotonic() - began
    assert batch["counts"] == {"succeeded": BATCH_SIZE} and batch["finished"] == BATCH_SIZE

    response = client.get(f"/v1/batches/{batch_id}/results")
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert [line["index"] for line in lines] == list(range(BATCH_SIZE))
    assert [line["metadata"]["row"] for line in lines] == list(range(BATCH_SIZE))
    assert len({line["job_id"] for line in lines}) == BATCH_SIZE
    for line in lines:
        answers = line["result"]["answers"]
        assert [a["id"] for a in answers] == ["terminate"] and answers[0]["choice"] in ("yes", "no")

    posts = wait_for(lambda: receiver.on(hook), timeout=30, message="batch webhook")
    secret = client.get("/v1/webhooks/secret").json()["secret"]
    assert verify_signature(secret, posts[0].headers[SIGNATURE_HEADER], posts[0].body)
    payload = json.loads(posts[0].body)
    assert payload["event"] == "batch.finished" and payload["batch"]["id"] == batch_id
    assert payload["batch"]["counts"] == {"succeeded": BATCH_SIZE}
    time.sleep(1.0)
    assert len(receiver.on(hook)) == 1  # once, although every job's finish checked the batch
    print(f"\nbatch of {BATCH_SIZE} decisions: stored in {stored:.2f}s, complete after {ran:.1f}s")


def test_job_cancelled_while_queued_still_gets_its_webhook(stack) -> None:  # type: ignore[no-untyped-def]
    _, client, receiver = stack
    hook = f"/cancelled/{uuid.uuid4().hex}"
    body = {"kind": "generate", "input": {"prompt": "x"}, "params": {"max_new_tokens": 4},
            "priority": "bulk", "webhook_url": receiver.url + hook}
    # Submitted through the batch path so the job can be cancelled before the worker sees it.
    batch = client.post("/v1/batches", json={"jobs": [body]}).json()
    client.post(f"/v1/batches/{batch['id']}/cancel")
    posts = wait_for(lambda: receiver.on(hook), timeout=30, message="sweeper webhook")
    payload = json.loads(posts[0].body)
    assert payload["job"]["status"] in ("cancelled", "succeeded")
