"""Webhook event filters end to end (issue 27): a real worker and the beat process deliver to a
receiver on 127.0.0.1, which gets exactly the events the job or batch named (and the default stays
one ``job.finished``). The sweeper runs every 0.5 s here, so a filtered-out final event would have
been recorded by it within the quiet period each test waits."""

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
from sqlalchemy import select

from api.app import create_app
from scheduler.infra.db import get_session_factory
from scheduler.infra.settings import Settings
from scheduler.webhooks.delivery import EVENT_HEADER
from scheduler.webhooks.tables import WebhookDelivery
from tests.conftest import ProcessLauncher, clear_leftover_jobs, wait_for
from tests.integration.webhook_receiver import WebhookReceiver

pytestmark = pytest.mark.integration

PROGRESS_INTERVAL = 0.3
QUIET = 1.5  # after the last expected event: three sweeps, and any stray delivery would be in


@pytest.fixture(scope="module")
def stack(make_settings: Callable[..., Settings], demo_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, TestClient, WebhookReceiver]]:
    settings = make_settings(model_dir=demo_checkpoint, auth="disabled", webhook_sweep_interval_seconds=0.5,
                             webhook_progress_interval_seconds=PROGRESS_INTERVAL,
                             webhook_allowed_networks=["127.0.0.0/8"])  # the loopback receiver (SSRF)
    clear_leftover_jobs(settings)
    launcher = ProcessLauncher(tmp_path_factory.mktemp("webhook-filter-logs"))
    receiver = WebhookReceiver().start()
    try:
        launcher.start_worker(settings)
        launcher.start_beat(settings)
        with TestClient(create_app(settings)) as client:
            yield settings, client, receiver
    finally:
        launcher.close()
        receiver.stop()


def _submit(client: TestClient, hook: str, events: list[str] | None, **params: Any) -> str:
    body: dict[str, Any] = {"kind": "generate", "input": {"prompt": "Hello"},
                            "params": {"max_new_tokens": 8, **params}, "webhook_url": hook}
    if events is not None:
        body["webhook_events"] = events
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    assert response.json()["webhook_events"] == events
    return str(response.json()["id"])


def _final(client: TestClient, job_id: str) -> str:
    def done() -> str | None:
        status = client.get(f"/v1/jobs/{job_id}").json()["status"]
        return status if status not in ("queued", "running") else None

    return str(wait_for(done, timeout=60, interval=0.1, message=f"job {job_id} final"))


def _events(receiver: WebhookReceiver, path: str) -> list[tuple[str, str]]:
    """(X-Cloverq-Event, the job's or batch's status in the body) of every POST to ``path``."""
    out = []
    for post in receiver.on(path):
        body = json.loads(post.body)
        assert body["event"] == post.headers[EVENT_HEADER]
        out.append((body["event"], (body.get("job") or body.get("batch") or {}).get("status")))
    return sorted(out)


def _settled(receiver: WebhookReceiver, path: str, count: int) -> list[tuple[str, str]]:
    wait_for(lambda: len(receiver.on(path)) >= count, timeout=30, message=f"{count} POSTs to {path}")
    time.sleep(QUIET)
    return _events(receiver, path)


def test_started_and_succeeded_only(stack) -> None:  # type: ignore[no-untyped-def]
    _, client, receiver = stack
    path = f"/filtered/{uuid.uuid4().hex}"
    job_id = _submit(client, receiver.url + path, ["started", "succeeded"])
    assert _final(client, job_id) == "succeeded"
    assert _settled(receiver, path, 2) == [("job.finished", "succeeded"), ("job.started", "running")]


def test_a_final_status_the_filter_leaves_out_sends_nothing(stack) -> None:  # type: ignore[no-untyped-def]
    _, client, receiver = stack
    # (a path starting with /fail answers 500 there)
    quiet, failing = f"/quiet/{uuid.uuid4().hex}", f"/on-failure/{uuid.uuid4().hex}"
    succeeded = _submit(client, receiver.url + quiet, ["failed"])
    failed = _submit(client, receiver.url + failing, ["failed"], fault="input")
    assert (_final(client, succeeded), _final(client, failed)) == ("succeeded", "failed")
    assert _settled(receiver, failing, 1) == [("job.finished", "failed")]
    assert receiver.on(quiet) == []  # neither the worker's hook nor the sweeper sent it


def test_default_is_one_job_finished(stack) -> None:  # type: ignore[no-untyped-def]
    _, client, receiver = stack
    path = f"/default/{uuid.uuid4().hex}"
    job_id = _submit(client, receiver.url + path, None)
    assert _final(client, job_id) == "succeeded"
    assert _settled(receiver, path, 1) == [("job.finished", "succeeded")]


def test_progress_is_throttled_and_alone(stack) -> None:  # type: ignore[no-untyped-def]
    settings, client, receiver = stack
    path = f"/progress/{uuid.uuid4().hex}"
    job_id = _submit(client, receiver.url + path, ["progress"], max_new_tokens=64, steps_per_block=8)
    assert _final(client, job_id) == "succeeded"
    time.sleep(QUIET)
    events = _events(receiver, path)
    assert events and {event for event, _ in events} == {"job.progress"}, events
    with get_session_factory(settings.resolved_database_url)() as session:
        rows = session.execute(select(WebhookDelivery.sequence, WebhookDelivery.created_at)
                               .where(WebhookDelivery.job_id == uuid.UUID(job_id))
                               .order_by(WebhookDelivery.created_at)).all()
    assert len(rows) == len(events) and len({row.sequence for row in rows}) == len(rows)
    gaps = [(b.created_at - a.created_at).total_seconds() for a, b in itertools.pairwise(rows)]
    assert all(gap >= PROGRESS_INTERVAL - 0.01 for gap in gaps), gaps
    print(f"\nprogress webhooks: {len(rows)}, gaps {gaps}")


def test_batch_filter_sends_job_starts_and_the_batch_end(stack) -> None:  # type: ignore[no-untyped-def]
    _, client, receiver = stack
    path = f"/batch/{uuid.uuid4().hex}"
    spec = {"kind": "generate", "input": {"prompt": "x"}, "params": {"max_new_tokens": 4}}
    response = client.post("/v1/batches", json={"jobs": [spec, spec], "webhook_url": receiver.url + path,
                                                "webhook_events": ["started", "batch_completed"]})
    assert response.status_code == 202, response.text
    assert response.json()["webhook_events"] == ["started", "batch_completed"]
    events = _settled(receiver, path, 3)
    assert events == [("batch.finished", "completed"), ("job.started", "running"), ("job.started", "running")]
