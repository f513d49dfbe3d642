"""The HTTP API on real databases (SQLite and PostgreSQL) and a real Redis.

No worker here (the worker flow is in ``test_api_worker.py``): these tests cover what the API
itself promises: 202 + Location, the job view, idempotency, cursor pagination and filters,
cancelling a queued job, tenancy, limits and error codes, 503 when the database is down.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.app import create_app
from scheduler.access.api_keys import create_key
from scheduler.infra.db import make_engine, session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job

pytestmark = pytest.mark.integration

PROMPT_BODY = {"kind": "generate", "input": {"prompt": "Hello"}, "params": {"max_new_tokens": 8}}


@pytest.fixture
def api_settings(
    make_settings: Callable[..., Settings], db_backend_url: str, demo_checkpoint: Path
) -> Settings:
    return make_settings(database_url=db_backend_url, model_dir=demo_checkpoint, auth="disabled",
                         fault_injection=False)


@pytest.fixture
def client(api_settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(api_settings)) as test_client:
        yield test_client


def _error_code(response) -> str:  # type: ignore[no-untyped-def]
    body = response.json()
    assert set(body["error"]) == {"code", "message", "details"}
    return str(body["error"]["code"])


def test_submit_answers_202_with_location_and_the_job_reads_back(client: TestClient) -> None:
    response = client.post("/v1/jobs", json=PROMPT_BODY)
    assert response.status_code == 202
    job = response.json()
    assert response.headers["Location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] == "queued"
    assert job["kind"] == "generate"
    assert job["queue"] in {"interactive", "standard", "bulk"}
    assert job["params"]["max_new_tokens"] == 8
    assert "steps_per_block" not in job["params"]  # unset: the worker applies the model family's default

    fetched = client.get(response.headers["Location"])
    assert fetched.status_code == 200
    assert fetched.json()["id"] == job["id"]
    assert fetched.json()["timings"]["created_at"] is not None


def test_idempotency_key_returns_the_original_job_and_conflicts_on_a_new_body(client: TestClient) -> None:
    headers = {"Idempotency-Key": "order-17"}
    first = client.post("/v1/jobs", json=PROMPT_BODY, headers=headers)
    repeat = client.post("/v1/jobs", json=PROMPT_BODY, headers=headers)
    assert first.status_code == 202
    assert repeat.status_code == 200
    assert repeat.json()["id"] == first.json()["id"]
    assert repeat.headers["Location"] == first.headers["Location"]

    other = {**PROMPT_BODY, "input": {"prompt": "something else"}}
    conflict = client.post("/v1/jobs", json=other, headers=headers)
    assert conflict.status_code == 409
    assert _error_code(conflict) == "idempotency_conflict"
    assert conflict.json()["error"]["details"]["job_id"] == first.json()["id"]


def test_list_pages_with_a_cursor_newest_first_and_filters(client: TestClient) -> None:
    since = datetime.now(UTC).isoformat()  # other tests share the database: page only ours
    created = [client.post("/v1/jobs", json=PROMPT_BODY).json()["id"] for _ in range(5)]
    seen: list[str] = []
    cursor: str | None = None
    while True:
        params: dict[str, str | int] = {"limit": 2, "created_after": since}
        if cursor:
            params["cursor"] = cursor
        page = client.get("/v1/jobs", params=params).json()
        assert len(page["items"]) <= 2
        seen += [item["id"] for item in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(created))  # every job once, newest first

    client.post(f"/v1/jobs/{created[0]}/cancel")
    cancelled = client.get("/v1/jobs", params={"status": "cancelled", "created_after": since}).json()["items"]
    assert created[0] in [item["id"] for item in cancelled]
    assert all(item["status"] == "cancelled" for item in cancelled)


def test_list_rejects_bad_filters_and_cursors(client: TestClient) -> None:
    assert _error_code(client.get("/v1/jobs", params={"status": "sleeping"})) == "invalid_request"
    assert _error_code(client.get("/v1/jobs", params={"cursor": "bm90IGEgY3Vyc29y"})) == "invalid_request"
    assert client.get("/v1/jobs", params={"limit": 0}).status_code == 422


def test_cancel_a_queued_job_at_once(client: TestClient) -> None:
    job_id = client.post("/v1/jobs", json=PROMPT_BODY).json()["id"]
    response = client.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status_code == 200
    assert response.json()["status"] == "cancelled"
    assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"
    again = client.post(f"/v1/jobs/{job_id}/cancel")  # a finished job is returned unchanged
    assert again.status_code == 200
    assert again.json()["status"] == "cancelled"


@pytest.mark.parametrize("job_id", ["not-a-uuid", "00000000-0000-0000-0000-000000000000"])
def test_unknown_jobs_are_404_job_not_found(client: TestClient, job_id: str) -> None:
    for response in (client.get(f"/v1/jobs/{job_id}"), client.post(f"/v1/jobs/{job_id}/cancel")):
        assert response.status_code == 404
        assert _error_code(response) == "job_not_found"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"kind": "generate", "input": {"prompt": "x"}, "extra": 1}, 422, "invalid_request"),
        ({"kind": "generate", "input": {}}, 422, "invalid_request"),
        ({"kind": "generate", "input": {"prompt": "x"}, "params": {"max_new_tokens": 10**6}}, 422,
         "invalid_request"),
        ({"kind": "generate", "input": {"prompt": "x"}, "params": {"steps_per_block": 10**4}}, 422,
         "invalid_request"),
        ({"kind": "generate", "input": {"prompt": "x"}, "params": {"step_budget": 10**7}}, 422,
         "invalid_request"),
        ({"kind": "generate", "input": {"prompt": "x"}, "params": {"fault": "always_fail"}}, 422,
         "invalid_request"),
        ({"kind": "generate", "input": {"prompt": "word " * 6000}}, 422, "prompt_too_long"),  # 18,001 tokens
        ({"kind": "generate", "input": {"prompt": "nul \u0000"}}, 422, "invalid_request"),
    ],
)
def test_client_mistakes_are_4xx_json_and_store_nothing(
    client: TestClient, api_settings: Settings, body: dict[str, object], status: int, code: str
) -> None:
    engine = make_engine(api_settings.resolved_database_url)

    def stored() -> int:
        with engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(Job)).scalar_one())

    before = stored()
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == status
    assert _error_code(response) == code
    assert stored() == before
    engine.dispose()


def test_body_over_the_limit_is_413(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings(auth="disabled", max_body_bytes=4096)
    with TestClient(create_app(settings)) as client:
        response = client.post("/v1/jobs", json={**PROMPT_BODY, "input": {"prompt": "x" * 5000}})
    assert response.status_code == 413
    assert _error_code(response) == "body_too_large"


def test_database_down_is_503_unavailable_fast(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings(auth="disabled", database_url="postgresql+psycopg://postgres@127.0.0.1:1/none")
    with TestClient(create_app(settings)) as client:
        for response in (client.get("/v1/jobs"), client.post("/v1/jobs", json=PROMPT_BODY),
                         client.get("/v1/jobs/00000000-0000-0000-0000-000000000000")):
            assert response.status_code == 503
            assert _error_code(response) == "unavailable"
        ready = client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["checks"]["database"]["ok"] is False
        assert client.get("/healthz").status_code == 200  # liveness touches nothing


def test_tenants_see_only_their_own_jobs(make_settings: Callable[..., Settings], migrated_db: str) -> None:
    settings = make_settings(auth="enabled", rate_limit_per_second=0)
    sessions = session_factory(make_engine(migrated_db))
    with sessions() as session:
        alice = create_key(session, tenant="alice", scopes=frozenset({"submit", "read"})).key
        bob = create_key(session, tenant="bob", scopes=frozenset({"submit", "read"})).key
        reader = create_key(session, tenant="alice", scopes=frozenset({"read"})).key
    with TestClient(create_app(settings)) as client:
        assert _error_code(client.post("/v1/jobs", json=PROMPT_BODY)) == "unauthorized"
        as_alice = {"Authorization": f"Bearer {alice}"}
        job_id = client.post("/v1/jobs", json=PROMPT_BODY, headers=as_alice).json()["id"]
        assert client.get(f"/v1/jobs/{job_id}", headers=as_alice).json()["tenant"] == "alice"
        as_bob = {"Authorization": f"Bearer {bob}"}
        assert client.get(f"/v1/jobs/{job_id}", headers=as_bob).status_code == 404
        assert client.post(f"/v1/jobs/{job_id}/cancel", headers=as_bob).status_code == 404
        assert job_id not in [j["id"] for j in client.get("/v1/jobs", headers=as_bob).json()["items"]]
        as_reader = {"Authorization": f"Bearer {reader}"}
        forbidden = client.post("/v1/jobs", json=PROMPT_BODY, headers=as_reader)
        assert forbidden.status_code == 403
        assert _error_code(forbidden) == "forbidden"
        assert client.get(f"/v1/jobs/{job_id}", headers=as_reader).status_code == 200


def test_readyz_reports_database_redis_and_ready_workers(client: TestClient, api_settings: Settings) -> None:
    import redis

    from scheduler.fleet.workers import ready_workers, unconsumed_classes

    response = client.get("/readyz")
    checks = response.json()["checks"]
    assert checks["database"]["ok"] is True
    assert checks["redis"]["ok"] is True
    # Workers of other tests may share this Redis: readiness must agree with the registry (ready
    # workers, and none of them off a queue its own state says it consumes).
    registry = redis.Redis.from_url(api_settings.resolved_redis_url, decode_responses=True)
    live = ready_workers(registry)
    has_workers = len(live) > 0
    all_consuming = not any(unconsumed_classes(w) for w in live)
    assert checks["workers"]["ok"] is has_workers
    assert checks["consumers"]["ok"] is all_consuming
    assert response.status_code == (200 if has_workers and all_consuming else 503)
    assert response.json()["ready"] is (has_workers and all_consuming)


def test_openapi_documents_the_job_routes(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel", "/healthz", "/readyz"} <= set(
        spec["paths"]
    )
    assert client.get("/docs").status_code == 200


def test_redis_down_still_accepts_jobs_durably(make_settings: Callable[..., Settings]) -> None:
    """SQL is the system of record: without Redis the job is stored (the reconciler publishes it)."""
    settings = make_settings(auth="disabled", redis_url="redis://127.0.0.1:1/0")
    with TestClient(create_app(settings)) as client:
        started = time.monotonic()
        response = client.post("/v1/jobs", json=PROMPT_BODY)
        assert response.status_code == 202, response.text
        assert time.monotonic() - started < 10  # publishing gives up fast
        job_id = response.json()["id"]
        assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
        ready = client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["checks"]["redis"]["ok"] is False
