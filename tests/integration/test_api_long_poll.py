"""Long polling (``GET /v1/jobs/{id}?wait=S``) on a real database and a real Redis.

The final status is written here the way a worker writes it (SQL commit, then the notice on
the jobs-finished channel), so these tests cover the API's side: it answers when the notice
arrives, answers with the status at the deadline when none does, and validates ``wait``. The
worker's own publishing is covered end to end in ``test_api_worker.py``.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient
from sqlalchemy import update

import api.job_follow as job_follow
from api.app import create_app
from scheduler.infra.db import make_engine, session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.finished_notice import publish_finished
from scheduler.jobs.models import Job, utcnow

pytestmark = pytest.mark.integration

BODY = {"kind": "generate", "input": {"prompt": "Hello"}, "params": {"max_new_tokens": 8}}


@pytest.fixture
def settings(make_settings: Callable[..., Settings], demo_checkpoint: Path, db_backend_url: str) -> Settings:
    # Both backends: the finisher writes the id through SQLAlchemy's Uuid type, which binds a
    # string on PostgreSQL but needs a uuid.UUID on SQLite (the embedded default).
    return make_settings(model_dir=demo_checkpoint, auth="disabled", fault_injection=False,
                         database_url=db_backend_url)


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def _finish_later(settings: Settings, job_id: str, delay: float) -> threading.Thread:
    """Mark the job succeeded after ``delay`` s and announce it, as the worker's finish path does."""

    def finish() -> None:
        time.sleep(delay)
        engine = make_engine(settings.resolved_database_url)
        with session_factory(engine)() as session:
            session.execute(update(Job).where(Job.id == uuid.UUID(job_id)).values(
                status="succeeded", result={"text": "done", "token_ids": [1]}, finished_at=utcnow()))
            session.commit()
        engine.dispose()
        publish_finished(redis_lib.Redis.from_url(settings.resolved_redis_url), job_id)

    thread = threading.Thread(target=finish, daemon=True)
    thread.start()
    return thread


def test_wait_answers_when_the_finished_notice_arrives(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Re-reads only at the deadline: an answer before it can only come from the notice.
    monkeypatch.setattr(job_follow, "RECHECK_SECONDS", 60.0)
    job_id = client.post("/v1/jobs", json=BODY).json()["id"]
    finisher = _finish_later(settings, job_id, delay=0.5)
    waited = client.get(f"/v1/jobs/{job_id}", params={"wait": 20})
    finisher.join()
    assert waited.status_code == 200
    assert waited.json()["status"] == "succeeded"
    assert waited.json()["result"]["text"] == "done"
    waiter = client.app.state.job_waiter  # type: ignore[attr-defined]
    assert waiter.notices >= 1
    assert waiter.waiting == 0  # the request unregistered itself


def test_wait_without_a_notice_answers_with_the_status_at_the_deadline(client: TestClient) -> None:
    job_id = client.post("/v1/jobs", json=BODY).json()["id"]
    began = time.monotonic()
    waited = client.get(f"/v1/jobs/{job_id}", params={"wait": 0.3})
    assert waited.status_code == 200 and waited.json()["status"] == "queued"
    assert time.monotonic() - began >= 0.3  # it did wait


def test_a_final_job_answers_at_once_and_wait_is_validated(client: TestClient) -> None:
    job_id = client.post("/v1/jobs", json=BODY).json()["id"]
    assert client.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    assert client.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()["status"] == "cancelled"
    for bad in ("31", "-1", "soon"):
        response = client.get(f"/v1/jobs/{job_id}", params={"wait": bad})
        assert response.status_code == 422, bad
        assert response.json()["error"]["code"] == "invalid_request"
    missing = client.get("/v1/jobs/00000000-0000-0000-0000-000000000000", params={"wait": 1})
    assert missing.status_code == 404
