"""The dashboard's admin JSON endpoints on a real database and Redis, with real API keys.

No worker: rows are put in their states with the job domain's own functions (submit, then the
fenced claim/finish a worker would do), so the counts, filters, detail and latency figures the
dashboard shows can be checked exactly.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from api.app import create_app
from scheduler.access.api_keys import create_key
from scheduler.infra import redis_keys
from scheduler.infra.db import get_session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.lifecycle import Lease, claim_job, finish_job
from scheduler.jobs.models import Job, JobStatus

pytestmark = pytest.mark.integration

SECRET_PROMPT = "the confidential merger memo"


@pytest.fixture
def settings(make_settings: Callable[..., Settings], db_backend_url: str, demo_checkpoint: Path) -> Settings:
    return make_settings(database_url=db_backend_url, model_dir=demo_checkpoint, fault_injection=False)


@pytest.fixture
def keys(settings: Settings) -> dict[str, str]:
    sessions = get_session_factory(settings.resolved_database_url)
    with sessions() as session:
        admin = create_key(session, tenant="ops", scopes=["admin"]).key
        alice = create_key(session, tenant="alice", scopes=["submit", "read"]).key
        bob = create_key(session, tenant="bob", scopes=["submit", "read"]).key
    return {"admin": admin, "alice": alice, "bob": bob}


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _submit(client: TestClient, key: str, tokens: int) -> str:
    body = {"kind": "generate", "input": {"prompt": SECRET_PROMPT}, "params": {"max_new_tokens": tokens}}
    response = client.post("/v1/jobs", json=body, headers=_auth(key))
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _run_to(settings: Settings, job_id: str, status: JobStatus, **finish: Any) -> None:
    """What a worker does: fenced claim, then fenced finish."""
    import uuid

    sessions = get_session_factory(settings.resolved_database_url)
    with sessions() as session:
        job = claim_job(
            session, job_id=uuid.UUID(job_id), worker_id="w-test", model_version="demo@t", settings=settings
        )
        assert job is not None
        lease = Lease(job.id, job.attempt)
        if status is not JobStatus.RUNNING:
            assert finish_job(session, lease=lease, status=status, settings=settings, **finish)


def test_admin_endpoints_need_an_admin_key(client: TestClient, keys: dict[str, str]) -> None:
    assert client.get("/dashboard").status_code == 200  # the static page itself needs no key
    assert client.get("/dashboard/app.js").status_code == 200
    for path in ("/v1/admin/overview", "/v1/admin/jobs", "/v1/admin/latency"):
        missing = client.get(path)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "unauthorized"
        tenant = client.get(path, headers=_auth(keys["alice"]))
        assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "forbidden"
        assert client.get(path, headers=_auth(keys["admin"])).status_code == 200


def test_overview_jobs_detail_and_latency_reflect_the_rows(
    client: TestClient, keys: dict[str, str], settings: Settings, redis_client: Any
) -> None:
    admin = _auth(keys["admin"])
    before = client.get("/v1/admin/overview", headers=admin).json()["counts"]["by_status"]
    done = _submit(client, keys["alice"], 8)
    failed = _submit(client, keys["bob"], 8)
    running = _submit(client, keys["bob"], 8)
    waiting = _submit(client, keys["alice"], 8)
    _run_to(
        settings,
        done,
        JobStatus.SUCCEEDED,
        steps_used=6,
        result={"text": "secret output", "finish_reason": "length", "usage": {"completion_tokens": 8}},
    )
    _run_to(settings, failed, JobStatus.FAILED, error_code="invalid_input", error_message="bad template")
    _run_to(settings, running, JobStatus.RUNNING)
    redis_client.set(
        redis_keys.progress(running),
        json.dumps(
            {
                "status": "running",
                "blocks_done": 2,
                "steps_used": 5,
                "tokens_committed": 8,
                "partial_text": "half of the secret output",
                "step_budget": None,
            }
        ),
    )

    overview = client.get("/v1/admin/overview", headers=admin).json()
    counts = overview["counts"]["by_status"]
    for status, added in (("succeeded", 1), ("failed", 1), ("running", 1), ("queued", 1)):
        assert counts[status] - before.get(status, 0) == added, status
    assert {q["name"] for q in overview["queues"]} >= {"interactive", "standard", "bulk", "joint"}
    assert overview["throughput"]["finished_last_minute"] >= 2
    assert not any(q["drained"] for q in overview["queues"])
    # a drained queue shows as drained (its queued jobs wait though a worker is ready)
    assert client.post("/v1/admin/queues/bulk/drain", headers=admin).status_code == 200
    try:
        rows = {q["name"]: q for q in client.get("/v1/admin/overview", headers=admin).json()["queues"]}
        assert rows["bulk"]["drained"] and not rows["interactive"]["drained"]
    finally:
        assert client.post("/v1/admin/queues/bulk/resume", headers=admin).status_code == 200

    listed = client.get("/v1/admin/jobs?limit=200", headers=admin).json()["items"]
    ids = {item["id"] for item in listed}
    assert {done, failed, running, waiting} <= ids  # every tenant's jobs
    assert {item["tenant"] for item in listed} >= {"alice", "bob"}
    only_failed = client.get("/v1/admin/jobs", params={"status": "failed", "tenant": "bob"}, headers=admin)
    assert [item["id"] for item in only_failed.json()["items"]] == [failed]
    bad_filter = client.get("/v1/admin/jobs", params={"status": "bogus"}, headers=admin)
    assert bad_filter.status_code == 422

    detail = client.get(f"/v1/admin/jobs/{done}", headers=admin).json()
    assert detail["status"] == "succeeded" and detail["steps_used"] == 6
    assert [e["event"] for e in detail["timeline"]] == ["created", "started", "finished", "expires"]
    assert detail["finish_reason"] == "length" and detail["usage"] == {"completion_tokens": 8}
    assert detail["worker_id"] == "w-test" and detail["model_version"] == "demo@t"
    assert detail["request_id"]
    hot = client.get(f"/v1/admin/jobs/{running}", headers=admin).json()
    assert hot["progress"]["blocks_done"] == 2 and "partial_text" not in hot["progress"]
    err = client.get(f"/v1/admin/jobs/{failed}", headers=admin).json()
    assert (err["error_code"], err["error_message"]) == ("invalid_input", "bad template")
    for job_id in (done, running, failed):
        text = client.get(f"/v1/admin/jobs/{job_id}", headers=admin).text
        assert SECRET_PROMPT not in text and "secret output" not in text  # no payloads for operators
    missing = client.get("/v1/admin/jobs/not-a-uuid", headers=admin)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "job_not_found"

    latency = client.get("/v1/admin/latency", headers=admin).json()
    finished_ids = {p["id"] for p in latency["points"]}
    assert {done, failed} <= finished_ids and running not in finished_ids
    assert all(p["run_seconds"] is not None and p["run_seconds"] >= 0 for p in latency["points"])


def test_a_traced_jobs_detail_links_to_the_trace_ui(
    make_settings: Callable[..., Settings], db_backend_url: str, demo_checkpoint: Path, keys: dict[str, str],
) -> None:
    """tracing_ui_url (docs/observability.md): the job's trace id, and the operator's trace page."""
    settings = make_settings(database_url=db_backend_url, model_dir=demo_checkpoint, fault_injection=False,
                             tracing_ui_url="https://traces.example/trace/{trace_id}?from=cloverq")
    with TestClient(create_app(settings)) as client:
        traced, untraced = _submit(client, keys["alice"], 8), _submit(client, keys["alice"], 8)
        with get_session_factory(settings.resolved_database_url)() as session:
            session.execute(update(Job).where(Job.id == uuid.UUID(traced)).values(trace_id="ab" * 16))
            session.commit()
        detail = client.get(f"/v1/admin/jobs/{traced}", headers=_auth(keys["admin"])).json()
        plain = client.get(f"/v1/admin/jobs/{untraced}", headers=_auth(keys["admin"])).json()
    assert detail["trace_id"] == "ab" * 16
    assert detail["trace_url"] == f"https://traces.example/trace/{'ab' * 16}?from=cloverq"
    assert plain["trace_id"] is None and plain["trace_url"] is None
    with pytest.raises(ValueError, match="tracing_ui_url"):
        make_settings(tracing_ui_url="javascript:alert(1)//{trace_id}")
