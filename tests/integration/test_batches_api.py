"""``/v1/batches`` on real databases (SQLite and PostgreSQL) and a real Redis, no worker.

What the API itself promises: JSON, raw JSONL and multipart uploads stored in one transaction
(a bad spec stores nothing), counts by status, results in submission order, cancel, tenancy.
The worker flow (1,000 decisions completing) is in ``test_batches_worker.py``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.app import create_app
from scheduler.batches.service import Batch
from scheduler.infra.db import get_session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job

pytestmark = pytest.mark.integration


def _decide(i: int) -> dict:
    return {"kind": "decide", "metadata": {"row": i},
            "input": {"context": f"contract {i}", "questions": [{"id": "ok", "text": "Is it fine?"}]}}


def _generate(i: int) -> dict:
    return {"kind": "generate", "input": {"prompt": f"p{i}"}, "params": {"max_new_tokens": 4}}


@pytest.fixture
def api_settings(
    make_settings: Callable[..., Settings], db_backend_url: str, demo_checkpoint: Path
) -> Settings:
    return make_settings(database_url=db_backend_url, model_dir=demo_checkpoint, auth="disabled",
                         fault_injection=False, batch_max_jobs=50, tenant_max_active_jobs=100_000)


@pytest.fixture
def sessions(api_settings: Settings) -> Any:
    """Sessions on the same database the app under test uses."""
    return get_session_factory(api_settings.resolved_database_url)


@pytest.fixture
def client(api_settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(api_settings)) as test_client:
        yield test_client


def _results(client: TestClient, batch_id: str) -> list[dict]:
    response = client.get(f"/v1/batches/{batch_id}/results")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


def test_json_batch_stored_with_counts_and_results_in_submission_order(
    client: TestClient, sessions: Any
) -> None:
    specs = [_decide(i) if i % 2 else _generate(i) for i in range(12)]
    response = client.post("/v1/batches", json={"jobs": specs, "metadata": {"run": "nightly"}})
    assert response.status_code == 202, response.text
    batch = response.json()
    assert response.headers["Location"] == f"/v1/batches/{batch['id']}"
    assert batch["total"] == 12 and batch["counts"] == {"queued": 12} and batch["status"] == "running"

    lines = _results(client, batch["id"])
    assert [line["index"] for line in lines] == list(range(12))
    assert [line["metadata"] for line in lines[1::2]] == [{"row": i} for i in range(1, 12, 2)]
    jobs = [client.get(f"/v1/jobs/{line['job_id']}").json() for line in lines]
    assert [job["kind"] for job in jobs] == [spec["kind"] for spec in specs]
    assert {job["queue"] for job in jobs} == {"bulk"}  # batch work is bulk class
    with sessions() as session:
        stored = session.get(Batch, uuid.UUID(batch["id"]))
        assert stored is not None and stored.total == 12 and stored.meta == {"run": "nightly"}
        assert session.scalar(select(func.count()).select_from(Job).where(Job.batch_id == stored.id)) == 12


def test_results_pages_by_keyset_into_the_same_lines(client: TestClient, sessions: Any) -> None:
    """The one keyset pager (``batches.service.iter_batch_jobs``) under both batch APIs (the OpenAI
    output file reads it too): pages of 5 over 12 jobs (two full pages and a short one) give the
    lines one page gives, in submission order."""
    from scheduler.batches import service

    response = client.post("/v1/batches", json={"jobs": [_decide(i) for i in range(12)]})
    assert response.status_code == 202, response.text
    batch_id = uuid.UUID(response.json()["id"])
    whole = list(service.iter_results(sessions, batch_id=batch_id))
    assert [line["index"] for line in whole] == list(range(12))
    assert list(service.iter_results(sessions, batch_id=batch_id, page=5)) == whole
    assert list(service.iter_results(sessions, batch_id=batch_id, page=6)) == whole  # a last full page
    pairs = list(service.iter_batch_jobs(sessions, batch_id=batch_id, page=5))
    assert [(seq, str(job.id)) for seq, job in pairs] == [(line["index"], line["job_id"]) for line in whole]
    assert [job.meta for _, job in pairs] == [line["metadata"] for line in whole]  # detached, still loaded


def test_jsonl_body_and_multipart_upload(client: TestClient) -> None:
    jsonl = "\n".join(json.dumps(_decide(i)) for i in range(5)) + "\n"
    raw = client.post("/v1/batches", content=jsonl.encode(),
                      headers={"Content-Type": "application/x-ndjson"})
    assert raw.status_code == 202, raw.text
    assert raw.json()["total"] == 5
    upload = client.post("/v1/batches", files={"file": ("specs.jsonl", jsonl.encode(), "application/jsonl")},
                         data={"metadata": json.dumps({"source": "upload"})})
    assert upload.status_code == 202, upload.text
    assert upload.json()["total"] == 5 and upload.json()["metadata"] == {"source": "upload"}
    lines = _results(client, upload.json()["id"])
    assert [line["metadata"]["row"] for line in lines] == list(range(5))


def test_one_bad_spec_rejects_the_whole_batch_and_stores_nothing(client: TestClient, sessions: Any) -> None:
    with sessions() as session:
        before = session.scalar(select(func.count()).select_from(Job))
    specs = [_decide(0), {"kind": "decide", "input": {"context": "x", "questions": []}}, _generate(2)]
    response = client.post("/v1/batches", json={"jobs": specs})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and error["details"][0]["index"] == 1
    too_many = client.post("/v1/batches", json={"jobs": [_generate(i) for i in range(51)]})
    assert too_many.status_code == 422 and too_many.json()["error"]["code"] == "batch_too_large"
    bad_line = client.post("/v1/batches", content=b'{"kind": "generate"\n',
                           headers={"Content-Type": "application/x-ndjson"})
    assert bad_line.status_code == 422
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == before


def test_cancel_cancels_every_queued_job(client: TestClient) -> None:
    batch = client.post("/v1/batches", json={"jobs": [_generate(i) for i in range(6)]}).json()
    cancelled = client.post(f"/v1/batches/{batch['id']}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json()["counts"] == {"cancelled": 6}
    assert cancelled.json()["status"] == "cancelled"
    assert {line["status"] for line in _results(client, batch["id"])} == {"cancelled"}


def test_cancel_of_a_finished_batch_returns_it_unchanged(client: TestClient, sessions: Any) -> None:
    """Every job final (here: run by hand to ``succeeded``): cancel has nothing to stop, and the batch
    stays ``completed`` on both batch APIs, as a finished job stays what it is."""
    batch = client.post("/v1/batches", json={"jobs": [_generate(i) for i in range(3)]}).json()
    with sessions() as session:
        for job in session.scalars(select(Job).where(Job.batch_id == uuid.UUID(batch["id"]))):
            job.status = "succeeded"
        session.commit()
    before = client.get(f"/v1/batches/{batch['id']}").json()
    assert before["status"] == "completed"
    cancelled = client.post(f"/v1/batches/{batch['id']}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json()["status"] == "completed" and cancelled.json()["counts"] == {"succeeded": 3}
    after = client.get(f"/v1/batches/{batch['id']}").json()
    assert after["status"] == "completed" and after["cancel_requested"] is False
    with sessions() as session:
        stored = session.get(Batch, uuid.UUID(batch["id"]))
        assert stored is not None and stored.cancel_requested is False


def test_unknown_or_malformed_batch_is_404(client: TestClient) -> None:
    for path in ("/v1/batches/nope", "/v1/batches/00000000-0000-0000-0000-000000000000/results"):
        response = client.get(path)
        assert response.status_code == 404 and response.json()["error"]["code"] == "batch_not_found"
