"""Data retention and purge (issue 27 part 3) on the real app, PostgreSQL / SQLite and Redis.

The jobs are finished the way a worker leaves them (``retention_traces.finish_like_a_worker``:
result text, hot status, event stream, webhook outbox), so no model runs here; the worker's own
run is in ``test_retention_logs.py``. After each purge the tests look for the job's text in every
table of the models and every Redis key (SCAN) and read the event stream endpoint.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient
from sqlalchemy import func, insert, select, text
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from scheduler.access.api_keys import create_key
from scheduler.batches.service import Batch
from scheduler.infra import redis_keys
from scheduler.infra.db import make_engine, session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job, utcnow
from scheduler.maintenance.retention_tick import due_query, pending_query, run_tick
from tests.integration.retention_traces import (
    finish_like_a_worker,
    keys_named_after,
    redis_holding,
    sql_holding,
)

pytestmark = pytest.mark.integration

HOOK = "http://127.0.0.1:9/hook"  # loopback: a sweep that ever sends it stays on this machine


@dataclass
class Api:
    settings: Settings
    client: TestClient
    sessions: sessionmaker[Session]
    redis: redis_lib.Redis
    tenant: str
    headers: dict[str, str]

    def count(self, model: Any) -> int:
        with self.sessions() as session:
            counted = select(func.count()).select_from(model).where(model.tenant == self.tenant)
            return int(session.scalar(counted) or 0)


@pytest.fixture
def api(make_settings: Callable[..., Settings], demo_checkpoint: Path) -> Iterator[Api]:
    settings = make_settings(model_dir=demo_checkpoint, webhook_allowed_networks=["127.0.0.0/8"])  # HOOK
    sessions = session_factory(make_engine(settings.resolved_database_url))
    tenant = f"retention-{uuid.uuid4().hex[:8]}"
    with sessions() as session:
        key = create_key(session, tenant=tenant, scopes=("submit", "read")).key
    with TestClient(create_app(settings)) as client:
        yield Api(settings, client, sessions, redis_lib.Redis.from_url(settings.resolved_redis_url), tenant,
                  {"Authorization": f"Bearer {key}"})


def _everywhere(api: Api, secret: str) -> list[str]:
    return sql_holding(api.sessions, secret) + [f"redis:{key}" for key in redis_holding(api.redis, secret)]


def test_purging_a_job_removes_its_text_everywhere_and_answers_a_tombstone(api: Api) -> None:
    secret = f"CONTRACT-{uuid.uuid4().hex}"
    body = {"kind": "generate", "input": {"prompt": f"Summarise {secret}"}, "params": {"max_new_tokens": 8},
            "retention_seconds": 3600, "webhook_url": HOOK}
    submitted = api.client.post("/v1/jobs", json=body, headers=api.headers)
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]
    assert submitted.json()["retention_seconds"] == 3600

    queued = api.client.delete(f"/v1/jobs/{job_id}/data", headers=api.headers)  # its input is still needed
    assert queued.status_code == 409 and queued.json()["error"]["code"] == "job_not_finished", queued.text
    assert "jobs.input" in sql_holding(api.sessions, secret)  # nothing purged

    finish_like_a_worker(api.sessions, api.redis, job_id, f"Clause {secret} binds")
    assert api.client.get(f"/v1/jobs/{job_id}", headers=api.headers).json()["result"]["text"].count(secret)
    before = _everywhere(api, secret)
    assert {"jobs.input", "jobs.result", "webhook_deliveries.payload"} <= set(before)
    assert {f"redis:{redis_keys.progress(job_id)}", f"redis:{redis_keys.events(job_id)}"} <= set(before)

    purged = api.client.delete(f"/v1/jobs/{job_id}/data", headers=api.headers)
    assert purged.status_code == 200, purged.text
    tombstone = purged.json()
    assert tombstone["purged_at"] and tombstone["result"] is None and tombstone["status"] == "succeeded"
    assert tombstone["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "steps_used": 4, "blocks": 2}
    assert tombstone["timings"]["finished_at"] and tombstone["timings"]["engine_run_ms"] == 200.0
    assert tombstone["tenant"] == api.tenant and tombstone["retention_seconds"] == 3600
    assert _everywhere(api, secret) == []
    assert keys_named_after(api.redis, job_id) <= {redis_keys.enqueued(job_id)}  # only the id-only marker
    stream = api.client.get(f"/v1/jobs/{job_id}/events", headers=api.headers)
    assert stream.status_code == 200 and secret not in stream.text
    assert "event: delta" not in stream.text and '"purged_at"' in stream.text

    again = api.client.delete(f"/v1/jobs/{job_id}/data", headers=api.headers)  # idempotent
    assert again.status_code == 200 and again.json()["purged_at"] == tombstone["purged_at"]
    assert api.client.get(f"/v1/jobs/{job_id}", headers=api.headers).json() == again.json()
    missing = api.client.delete(f"/v1/jobs/{uuid.uuid4()}/data", headers=api.headers)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "job_not_found"


def test_a_batch_purge_covers_every_job_and_the_openai_input_file(api: Api) -> None:
    secret = f"CONTRACT-{uuid.uuid4().hex}"
    model = api.client.get("/openai/v1/models", headers=api.headers).json()["data"][0]["id"]
    lines = [{"custom_id": name, "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": f"{name}: {secret}", "echo": True, "stop": [secret],
                       "max_tokens": 4}} for name in ("first", "second")]
    upload = api.client.post("/openai/v1/files", headers=api.headers, data={"purpose": "batch"},
                             files={"file": ("in.jsonl", "\n".join(json.dumps(x) for x in lines).encode())})
    assert upload.status_code == 200, upload.text
    created = api.client.post("/openai/v1/batches", headers=api.headers, json={
        "input_file_id": upload.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h",
        "retention_seconds": 600})
    assert created.status_code == 200, created.text
    batch_id = created.json()["cloverq_batch_id"]
    jobs = api.client.get("/v1/jobs", headers=api.headers).json()["items"]
    assert sorted(job["retention_seconds"] for job in jobs) == [600, 600]

    refused = api.client.delete(f"/v1/batches/{batch_id}/data", headers=api.headers)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "batch_not_finished"
    assert refused.json()["error"]["details"]["active_jobs"] == 2
    assert "openai_files.content" in sql_holding(api.sessions, secret)  # all or nothing: nothing purged

    finish_like_a_worker(api.sessions, api.redis, jobs[0]["id"], f"out {secret}")
    finish_like_a_worker(api.sessions, api.redis, jobs[1]["id"], secret, failed=True)
    assert {"jobs.input", "jobs.result", "jobs.error_message", "openai_files.content",
            "openai_batches.requests"} <= set(_everywhere(api, secret))

    purged = api.client.delete(f"/v1/batches/{batch_id}/data", headers=api.headers)
    assert purged.status_code == 200, purged.text
    assert purged.json()["purged_at"] and purged.json()["counts"] == {"succeeded": 1, "failed": 1}
    assert _everywhere(api, secret) == []
    for job in jobs:
        view = api.client.get(f"/v1/jobs/{job['id']}", headers=api.headers).json()
        assert view["purged_at"] and view["result"] is None
    failed = [api.client.get(f"/v1/jobs/{job['id']}", headers=api.headers).json() for job in jobs]
    assert {"code": "invalid_input", "message": None} in [view["error"] for view in failed]
    results = api.client.get(f"/v1/batches/{batch_id}/results", headers=api.headers)
    assert results.status_code == 200 and secret not in results.text
    again = api.client.delete(f"/v1/batches/{batch_id}/data", headers=api.headers)
    assert again.status_code == 200 and again.json()["purged_at"] == purged.json()["purged_at"]


def test_retention_above_the_tenant_maximum_or_negative_is_422_and_stores_nothing(
    api: Api, redis_url: str
) -> None:
    with api.sessions() as session:
        admin = create_key(session, tenant=f"ops-{uuid.uuid4().hex[:6]}", scopes=("admin",)).key
    limits = {"tenants": {api.tenant: {"retention_max_seconds": 60, "retention_default_seconds": 30}}}
    patched = api.client.patch("/v1/admin/limits", json=limits, headers={"Authorization": f"Bearer {admin}"})
    assert patched.status_code == 200, patched.text
    assert patched.json()["overrides"][f"retention_max:{api.tenant}"] == 60
    try:
        job = {"kind": "generate", "input": {"prompt": "x"}}
        for retention, code in ((61, "retention_too_long"), (-1, "invalid_request")):
            refused = api.client.post("/v1/jobs", json={**job, "retention_seconds": retention},
                                      headers=api.headers)
            assert refused.status_code == 422 and refused.json()["error"]["code"] == code, refused.text
        too_long = [("/v1/batches", {"jobs": [job], "retention_seconds": 61}, None),
                    ("/v1/batches", {"jobs": [job, {**job, "retention_seconds": 61}]}, None),
                    ("/v1/batches?retention_seconds=61", None, json.dumps(job))]
        for path, body, jsonl in too_long:
            refused = (api.client.post(path, json=body, headers=api.headers) if jsonl is None else
                       api.client.post(path, content=jsonl, headers={**api.headers,
                                                                     "Content-Type": "application/x-ndjson"}))
            assert refused.status_code == 422 and refused.json()["error"]["code"] == "retention_too_long"
        model = api.client.get("/v1/models", headers=api.headers).json()["data"][0]["id"]
        chat = {"model": model, "messages": [{"role": "user", "content": "x"}], "retention_seconds": 61}
        refused = api.client.post("/v1/chat/completions", json=chat, headers=api.headers)  # OpenAI: 400
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "retention_too_long"
        assert (api.count(Job), api.count(Batch)) == (0, 0)

        default = api.client.post("/v1/jobs", json=job, headers=api.headers).json()
        assert default["retention_seconds"] == 30  # the tenant's default
        batch = api.client.post("/v1/batches", json={"jobs": [job, {**job, "retention_seconds": 10}],
                                                     "retention_seconds": 45}, headers=api.headers)
        assert batch.status_code == 202 and batch.json()["retention_seconds"] == 45
        with api.sessions() as session:
            kept = session.scalars(select(Job.retention_seconds)
                                   .where(Job.batch_id == uuid.UUID(batch.json()["id"]))).all()
        assert sorted(kept) == [10, 45]
    finally:
        fields = ("retention_max_seconds", "retention_default_seconds")
        cleared = {"tenants": {api.tenant: dict.fromkeys(fields)}}
        api.client.patch("/v1/admin/limits", json=cleared, headers={"Authorization": f"Bearer {admin}"})


def _insert_job(sessions: sessionmaker[Session], *, secret: str, status: str, finished_ago: float | None,
                retention: int | None) -> uuid.UUID:
    now = utcnow()
    job_id = uuid.uuid4()
    row: dict[str, Any] = {
        "id": job_id, "tenant": "tick", "kind": "generate", "status": status, "priority": "bulk",
        "queue": "bulk", "cost": 1, "input": {"prompt": secret}, "params": {}, "steps_used": 0, "attempt": 1,
        "max_attempts": 3, "cancel_requested": False, "created_at": now, "available_at": now,
        "updated_at": now, "retention_seconds": retention}
    if finished_ago is not None:
        row.update(finished_at=now - timedelta(seconds=finished_ago),
                   result={"text": secret, "usage": {"completion_tokens": 1}})
    with sessions() as session:
        session.execute(insert(Job), row)
        session.commit()
    return job_id


def test_the_purge_tick_purges_due_jobs_once_and_expired_ones_too(
    make_settings: Callable[..., Settings], redis_client: redis_lib.Redis
) -> None:
    settings = make_settings()
    sessions = session_factory(make_engine(settings.resolved_database_url))
    secret = f"CONTRACT-{uuid.uuid4().hex}"
    due = _insert_job(sessions, secret=secret, status="succeeded", finished_ago=120, retention=60)
    later = _insert_job(sessions, secret=secret, status="failed", finished_ago=120, retention=3600)
    expired = _insert_job(sessions, secret=secret, status="expired", finished_ago=8 * 86400, retention=None)
    running = _insert_job(sessions, secret=secret, status="running", finished_ago=None, retention=0)
    redis_client.set(redis_keys.progress(due), json.dumps({"partial_text": secret}))
    now = utcnow()
    # Other tests' jobs may be due too: the tick is bounded, so run it until it has nothing left.
    while run_tick(sessions(), redis_client=redis_client, settings=settings, now=now).purged:
        pass
    with sessions() as session:
        rows = {job.id: job for job in session.scalars(select(Job).where(Job.id.in_([due, later, expired,
                                                                                          running])))}
    assert rows[due].purged_at == now and rows[due].input is None and rows[due].purge_at is None
    assert rows[due].result == {"usage": {"completion_tokens": 1}}
    assert rows[expired].purged_at == now  # expiry and retention end alike: a tombstone
    assert rows[later].purged_at is None and rows[later].input == {"prompt": secret}
    assert rows[later].purge_at == rows[later].finished_at + timedelta(seconds=3600)  # scheduled once
    assert rows[running].purge_at is None and rows[running].input == {"prompt": secret}
    assert not redis_client.exists(redis_keys.progress(due))
    again = run_tick(sessions(), redis_client=redis_client, settings=settings, now=now)
    assert (again.scheduled, again.purged) == (0, 0)  # idempotent: nothing left to do
    run_tick(sessions(), redis_client=redis_client, settings=settings, now=now + timedelta(seconds=3600))
    with sessions() as session:
        assert session.get(Job, later).purged_at is not None  # type: ignore[union-attr]
        assert session.get(Job, running).purged_at is None  # type: ignore[union-attr]


def test_the_purge_tick_queries_are_partial_index_scans(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings()
    engine = make_engine(settings.resolved_database_url)
    if engine.dialect.name != "postgresql":
        pytest.skip("EXPLAIN is PostgreSQL's")
    with engine.connect() as conn:
        conn.execute(text("SET enable_seqscan = off"))  # a tiny table would be scanned anyway
        for query, index in ((pending_query(10), "ix_jobs_purge_pending"),
                             (due_query(utcnow(), 10), "ix_jobs_purge_due")):
            compiled = query.compile(engine)
            plan = "\n".join(row[0] for row in conn.exec_driver_sql(f"EXPLAIN {compiled}", compiled.params))
            assert index in plan, plan
