"""Security rules over HTTP on the real app, real database and real Redis (issue 6, "Must show").

Each test uses tenants of its own (random names), so jobs other tests leave behind never
count against its caps, and clears the runtime limit overrides it sets.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.app import create_app
from scheduler.access.api_keys import create_key
from scheduler.fleet.operator_state import clear_operator_state
from scheduler.infra.db import make_engine, session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job

pytestmark = pytest.mark.integration

JOB = {"kind": "generate", "input": {"prompt": "The contract says"}, "params": {"max_new_tokens": 8}}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Stack:
    """The API app of one test plus helpers to make keys and count stored jobs."""

    def __init__(self, settings: Settings, client: TestClient) -> None:
        self.settings = settings
        self.client = client
        self.sessions = session_factory(make_engine(settings.resolved_database_url))

    def key(self, tenant: str, scopes: tuple[str, ...] = ("submit", "read")) -> str:
        with self.sessions() as session:
            return create_key(session, tenant=tenant, scopes=scopes).key

    def jobs_of(self, tenant: str) -> int:
        with self.sessions() as session:
            return int(session.scalar(select(func.count()).select_from(Job).where(Job.tenant == tenant)) or 0)

    def submit(
        self, key: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None
    ) -> Any:
        return self.client.post("/v1/jobs", json=body or JOB, headers={**bearer(key), **(headers or {})})


@pytest.fixture
def make_stack(make_settings: Callable[..., Settings], redis_url: str,
               migrated_db: str) -> Iterator[Callable[..., Stack]]:
    clients: list[TestClient] = []

    def build(**overrides: Any) -> Stack:
        settings = make_settings(**overrides)
        client = TestClient(create_app(settings))
        client.__enter__()
        clients.append(client)
        return Stack(settings, client)

    yield build
    for client in clients:
        client.__exit__(None, None, None)
    with session_factory(make_engine(migrated_db))() as session:  # SQL too: API starts restore it
        clear_operator_state(session, redis_lib.Redis.from_url(redis_url))


@pytest.fixture
def stack(make_stack: Callable[..., Stack]) -> Stack:
    return make_stack()


def tenant_name() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def assert_error(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert body["error"]["code"] == code
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


# --- authentication -----------------------------------------------------------------------------


def test_no_key_or_a_bad_key_is_401(stack: Stack) -> None:
    key = stack.key(tenant_name())
    forged = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    for headers in (
        {},
        {"Authorization": "Bearer"},
        {"Authorization": "Basic dXNlcjpwdw=="},
        bearer("not-a-key"),
        bearer(forged),
        bearer("cq_000000000000_" + "x" * 43),
    ):
        response = stack.client.get("/v1/jobs", headers=headers)
        assert_error(response, 401, "unauthorized")
        assert response.headers["www-authenticate"] == "Bearer"
    assert stack.client.get("/v1/jobs", headers=bearer(key)).status_code == 200
    basic = stack.client.get("/v1/jobs", headers={"Authorization": "Basic dXNlcjpwdw=="}).json()["error"]
    assert "uses the 'Basic' scheme; send the API key as 'Authorization: Bearer <key>'" in basic["message"]
    bare = stack.client.get("/v1/jobs", headers={"Authorization": key}).json()["error"]["message"]
    assert "uses no scheme" in bare and key not in bare and key[:12] not in bare  # a bare key is never echoed


def test_revoked_key_is_401_at_once(stack: Stack) -> None:
    tenant = tenant_name()
    key, admin = stack.key(tenant), stack.key(tenant_name(), ("admin",))
    assert stack.client.get("/v1/jobs", headers=bearer(key)).status_code == 200  # now cached
    key_id = key.split("_")[1]
    revoked = stack.client.post(f"/v1/admin/keys/{key_id}/revoke", headers=bearer(admin))
    assert revoked.status_code == 200 and revoked.json()["revoked"] is True
    assert_error(stack.client.get("/v1/jobs", headers=bearer(key)), 401, "unauthorized")
    assert_error(stack.submit(key), 401, "unauthorized")
    assert stack.jobs_of(tenant) == 0


def test_revoked_key_is_refused_by_another_api_process(make_stack: Callable[..., Stack]) -> None:
    """Revocation reaches every API process through Redis, not only the one that revoked."""
    first, second = make_stack(), make_stack()
    key, admin = first.key(tenant_name()), first.key(tenant_name(), ("admin",))
    assert second.client.get("/v1/jobs", headers=bearer(key)).status_code == 200  # cached there
    first.client.post(f"/v1/admin/keys/{key.split('_')[1]}/revoke", headers=bearer(admin))
    assert_error(second.client.get("/v1/jobs", headers=bearer(key)), 401, "unauthorized")


# --- scopes ---------------------------------------------------------------------------------------


def test_missing_scope_is_403(stack: Stack) -> None:
    tenant = tenant_name()
    reader, submitter = stack.key(tenant, ("read",)), stack.key(tenant, ("submit",))
    error = assert_error(stack.submit(reader), 403, "forbidden")
    assert error["details"] == {"required_scope": "submit"}
    assert stack.jobs_of(tenant) == 0
    job = stack.submit(submitter)
    assert job.status_code == 202
    assert_error(
        stack.client.get(f"/v1/jobs/{job.json()['id']}", headers=bearer(submitter)), 403, "forbidden"
    )
    assert_error(stack.client.get("/v1/jobs", headers=bearer(submitter)), 403, "forbidden")
    for path in (
        "/v1/admin/workers",
        "/v1/admin/queues",
        "/v1/admin/limits",
        "/v1/admin/keys",
        "/v1/admin/overview",
    ):
        assert_error(stack.client.get(path, headers=bearer(reader)), 403, "forbidden")
    assert_error(
        stack.client.post("/v1/admin/queues/bulk/drain", headers=bearer(submitter)), 403, "forbidden"
    )
    assert_error(
        stack.client.patch("/v1/admin/limits", json={"rate_burst": 5}, headers=bearer(reader)),
        403,
        "forbidden",
    )


# --- tenancy --------------------------------------------------------------------------------------


def test_cross_tenant_get_cancel_and_list(stack: Stack) -> None:
    tenant_a, tenant_b = tenant_name(), tenant_name()
    key_a, key_b = stack.key(tenant_a), stack.key(tenant_b)
    admin = stack.key(tenant_name(), ("admin",))
    job_a = stack.submit(key_a).json()["id"]
    job_b = stack.submit(key_b).json()["id"]

    error = assert_error(stack.client.get(f"/v1/jobs/{job_a}", headers=bearer(key_b)), 404, "job_not_found")
    assert error["details"] == {"job_id": job_a}
    assert_error(stack.client.post(f"/v1/jobs/{job_a}/cancel", headers=bearer(key_b)), 404, "job_not_found")
    still = stack.client.get(f"/v1/jobs/{job_a}", headers=bearer(key_a)).json()
    assert still["status"] == "queued"  # the foreign cancel changed nothing

    listed_b = stack.client.get("/v1/jobs", headers=bearer(key_b), params={"limit": 200}).json()
    assert [item["id"] for item in listed_b["items"]] == [job_b]

    # A 404 for another tenant's job is indistinguishable from a job that does not exist.
    missing = stack.client.get(f"/v1/jobs/{uuid.uuid4()}", headers=bearer(key_b))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "job_not_found"

    # The admin scope sees every tenant.
    assert stack.client.get(f"/v1/jobs/{job_a}", headers=bearer(admin)).status_code == 200
    assert stack.client.get(f"/v1/jobs/{job_b}", headers=bearer(admin)).status_code == 200
    ids = {
        item["id"]
        for item in stack.client.get("/v1/jobs", headers=bearer(admin), params={"limit": 200}).json()["items"]
    }
    assert {job_a, job_b} <= ids


# --- admission control ------------------------------------------------------------------------------


def test_rate_limit_is_429_with_retry_after_and_stores_nothing(stack: Stack) -> None:
    tenant = tenant_name()
    key, admin = stack.key(tenant), stack.key(tenant_name(), ("admin",))
    key_id = key.split("_")[1]
    patched = stack.client.patch(
        "/v1/admin/limits",
        headers=bearer(admin),
        json={"keys": {key_id: {"rate_per_second": 0.2, "rate_burst": 2}}},
    )
    assert patched.status_code == 200, patched.text
    assert patched.json()["overrides"][f"rate_burst:{key_id}"] == 2

    assert stack.submit(key).status_code == 202
    assert stack.submit(key).status_code == 202
    refused = stack.submit(key)
    error = assert_error(refused, 429, "rate_limited")
    retry_after = int(refused.headers["retry-after"])
    assert 1 <= retry_after <= 5  # one token at 0.2/s takes 5 s
    assert error["details"]["retry_after_seconds"] == retry_after
    assert stack.jobs_of(tenant) == 2
    # Other keys are not affected by this key's bucket.
    assert stack.submit(stack.key(tenant)).status_code == 202


def _markers(redis_url: str) -> int:
    client = redis_lib.Redis.from_url(redis_url)
    return sum(1 for _ in client.scan_iter(match="cloverq:enqueued:*", count=1000))


def test_submit_takes_its_token_in_the_admission_round_trip(stack: Stack, redis_url: str) -> None:
    """POST /v1/jobs meters in the same Redis script as its queue check: a refused submit
    spends nothing and leaves no enqueued marker behind, and an idempotent repeat (which
    skips admission) is still metered."""
    tenant = tenant_name()
    key, admin = stack.key(tenant), stack.key(tenant_name(), ("admin",))
    key_id = key.split("_")[1]
    limits = {"keys": {key_id: {"rate_per_second": 0.01, "rate_burst": 2}}}
    assert stack.client.patch("/v1/admin/limits", headers=bearer(admin), json=limits).status_code == 200

    first = stack.submit(key, headers={"Idempotency-Key": "once"})
    assert first.status_code == 202
    markers = _markers(redis_url)
    repeat = stack.submit(key, headers={"Idempotency-Key": "once"})
    assert repeat.status_code == 200 and repeat.json()["id"] == first.json()["id"]  # 2nd token
    assert_error(stack.submit(key, headers={"Idempotency-Key": "once"}), 429, "rate_limited")
    assert_error(stack.submit(key), 429, "rate_limited")
    # Refused before admission (a limit, a scope) still spends a token: no free tokenizer work.
    too_long = {**JOB, "params": {"max_new_tokens": 10**6}}  # over the limit, within the schema's bound
    assert_error(stack.submit(key, body=too_long), 429, "rate_limited")
    assert _markers(redis_url) == markers
    assert stack.jobs_of(tenant) == 1


def test_bodies_refused_by_the_schema_spend_tokens_too(stack: Stack) -> None:
    """Issue 16: schema-invalid submits were never rate-limited (the route, which meters, never
    ran), nor was JSON that does not parse (refused before authentication)."""
    tenant = tenant_name()
    key, admin = stack.key(tenant), stack.key(tenant_name(), ("admin",))
    key_id = key.split("_")[1]
    limits = {"keys": {key_id: {"rate_per_second": 0.01, "rate_burst": 2}}}
    assert stack.client.patch("/v1/admin/limits", headers=bearer(admin), json=limits).status_code == 200

    assert_error(stack.submit(key, body={"kind": "generate"}), 422, "invalid_request")  # 1st token
    unparsable = stack.client.post("/v1/jobs", content=b"{not json", headers={
        **bearer(key), "content-type": "application/json"})
    assert_error(unparsable, 422, "invalid_request")  # 2nd token
    assert_error(stack.submit(key, body={"kind": "generate"}), 429, "rate_limited")
    assert_error(stack.submit(key), 429, "rate_limited")  # the bucket is empty for valid ones too
    assert stack.jobs_of(tenant) == 0


def test_submit_with_a_key_revoked_elsewhere_is_401(make_stack: Callable[..., Stack]) -> None:
    """The submit path's combined script reports a revocation made by another API process
    while this one still has the key cached."""
    first, second = make_stack(), make_stack()
    tenant = tenant_name()
    key, admin = first.key(tenant), first.key(tenant_name(), ("admin",))
    assert second.submit(key).status_code == 202  # cached in the second process
    first.client.post(f"/v1/admin/keys/{key.split('_')[1]}/revoke", headers=bearer(admin))
    assert_error(second.submit(key), 401, "unauthorized")
    assert second.jobs_of(tenant) == 1


def test_queue_depth_cap_is_429_at_once_and_stores_nothing(stack: Stack) -> None:
    tenant = tenant_name()
    key, admin = stack.key(tenant), stack.key(tenant_name(), ("admin",))
    patch = stack.client.patch(
        "/v1/admin/limits", headers=bearer(admin), json={"queue_max_depth": {"interactive": 1}}
    )
    assert patch.json()["effective"]["queue_max_depth"]["interactive"] == 1
    accepted = 0
    refused = None
    for _ in range(3):  # the queue holds >= 1 message after at most one accepted submit
        response = stack.submit(key)
        if response.status_code == 429:
            refused = response
            break
        assert response.status_code == 202 and response.json()["queue"] == "interactive"
        accepted += 1
    assert refused is not None, "the queue cap never refused a submit"
    error = assert_error(refused, 429, "queue_full")
    assert error["details"]["queue"] == "interactive" and error["details"]["max_depth"] == 1
    assert int(refused.headers["retry-after"]) >= 1
    assert stack.jobs_of(tenant) == accepted
    # Another queue is not capped by it: a long job routes to bulk and is accepted.
    long_job = {**JOB, "params": {"max_new_tokens": 2048, "steps_per_block": 64}}
    response = stack.submit(key, long_job)
    assert response.status_code == 202 and response.json()["queue"] != "interactive"


def test_tenant_cap_is_429_and_stores_nothing(stack: Stack) -> None:
    tenant, other = tenant_name(), tenant_name()
    key, other_key, admin = stack.key(tenant), stack.key(other), stack.key(tenant_name(), ("admin",))
    stack.client.patch(
        "/v1/admin/limits", headers=bearer(admin), json={"tenants": {tenant: {"max_active": 2}}}
    )
    assert stack.submit(key).status_code == 202
    assert stack.submit(key).status_code == 202
    error = assert_error(stack.submit(key), 429, "tenant_limit")
    assert error["details"] == {"active_jobs": 2, "max_active_jobs": 2,
                                "setting": "CLOVERQ_TENANT_MAX_ACTIVE_JOBS"}
    assert "The cap is an operator override of CLOVERQ_TENANT_MAX_ACTIVE_JOBS" in error["message"]
    assert stack.jobs_of(tenant) == 2
    assert stack.submit(other_key).status_code == 202  # the cap is per tenant
    # A finished (cancelled) job no longer counts.
    first = stack.client.get("/v1/jobs", headers=bearer(key)).json()["items"][0]["id"]
    assert stack.client.post(f"/v1/jobs/{first}/cancel", headers=bearer(key)).json()["status"] == "cancelled"
    assert stack.submit(key).status_code == 202


def test_idempotent_repeat_is_not_refused_by_the_tenant_cap(stack: Stack) -> None:
    tenant = tenant_name()
    key, admin = stack.key(tenant), stack.key(tenant_name(), ("admin",))
    stack.client.patch(
        "/v1/admin/limits", headers=bearer(admin), json={"tenants": {tenant: {"max_active": 1}}}
    )
    first = stack.submit(key, headers={"Idempotency-Key": "order-1"})
    assert first.status_code == 202
    assert_error(stack.submit(key), 429, "tenant_limit")
    again = stack.submit(key, headers={"Idempotency-Key": "order-1"})
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]


def test_oversized_body_is_413_and_stores_nothing(stack: Stack) -> None:
    tenant = tenant_name()
    key = stack.key(tenant)
    big = {**JOB, "input": {"prompt": "x" * (stack.settings.limits.max_body_bytes + 10)}}
    response = stack.submit(key, big)
    error = assert_error(response, 413, "body_too_large")
    assert error["details"]["max_body_bytes"] == stack.settings.limits.max_body_bytes
    assert stack.jobs_of(tenant) == 0


def test_auth_disabled_is_an_explicit_dev_mode(make_stack: Callable[..., Stack]) -> None:
    dev = make_stack(auth="disabled")
    response = dev.client.post("/v1/jobs", json=JOB)
    assert response.status_code == 202
    assert dev.client.get(f"/v1/jobs/{response.json()['id']}").status_code == 200
    enabled = make_stack()
    assert_error(enabled.client.get(f"/v1/jobs/{response.json()['id']}"), 401, "unauthorized")


def test_batch_over_the_tenant_cap_is_429_and_stores_nothing(stack: Stack) -> None:
    tenant = tenant_name()
    key, admin = stack.key(tenant), stack.key(tenant_name(), ("admin",))
    stack.client.patch(
        "/v1/admin/limits", headers=bearer(admin), json={"tenants": {tenant: {"max_active": 3}}}
    )
    assert stack.submit(key).status_code == 202
    refused = stack.client.post("/v1/batches", json={"jobs": [JOB, JOB, JOB]}, headers=bearer(key))
    error = assert_error(refused, 429, "tenant_limit")
    assert error["details"] == {"active_jobs": 1, "max_active_jobs": 3,
                                "setting": "CLOVERQ_TENANT_MAX_ACTIVE_JOBS"}
    assert stack.jobs_of(tenant) == 1
    accepted = stack.client.post("/v1/batches", json={"jobs": [JOB, JOB]}, headers=bearer(key))
    assert accepted.status_code == 202, accepted.text
    assert stack.jobs_of(tenant) == 3


def test_nul_characters_are_a_client_error_never_a_5xx(stack: Stack) -> None:
    """PostgreSQL cannot store U+0000 in text or JSONB; found by the schemathesis run."""
    tenant = tenant_name()
    key = stack.key(tenant)
    response = stack.submit(key, {**JOB, "input": {"prompt": "a\u0000b"}})
    assert response.status_code in (202, 422), response.text  # SQLite stores it, PostgreSQL cannot
    if response.status_code == 422:
        assert response.json()["error"]["code"] == "invalid_request"
        assert stack.jobs_of(tenant) == 0
    listed = stack.client.get("/v1/jobs", headers=bearer(key), params={"kind": "x\u0000"})
    assert listed.status_code in (200, 422), listed.text


def test_rate_limit_bucket_refills(stack: Stack) -> None:
    key, admin = stack.key(tenant_name()), stack.key(tenant_name(), ("admin",))
    key_id = key.split("_")[1]
    stack.client.patch(
        "/v1/admin/limits",
        headers=bearer(admin),
        # 1 token/s: the second request is refused however slowly the first one is answered (at
        # 10 tokens/s a first answer slower than 0.1 s on a loaded machine refilled the bucket).
        json={"keys": {key_id: {"rate_per_second": 1, "rate_burst": 1}}},
    )
    assert stack.client.get("/v1/jobs", headers=bearer(key)).status_code == 200
    refused = stack.client.get("/v1/jobs", headers=bearer(key))
    assert_error(refused, 429, "rate_limited")
    assert refused.headers["retry-after"] == "1"  # under 1 s rounded up to whole seconds
    time.sleep(1.1)  # 1 token/s: one token is back
    assert stack.client.get("/v1/jobs", headers=bearer(key)).status_code == 200
    # Clearing the override (null) puts the key back on the defaults.
    cleared = stack.client.patch(
        "/v1/admin/limits", headers=bearer(admin), json={"keys": {key_id: {"rate_burst": None}}}
    )
    assert f"rate_burst:{key_id}" not in cleared.json()["overrides"]
    # A key id that names no key is refused (a typo would limit nothing); clearing one is not.
    typo = stack.client.patch("/v1/admin/limits", headers=bearer(admin),
                              json={"keys": {"0123456789ab": {"rate_burst": 5}}})
    assert_error(typo, 404, "key_not_found")
    in_force = stack.client.get("/v1/admin/limits", headers=bearer(admin)).json()
    assert "rate_burst:0123456789ab" not in in_force["overrides"]
    gone = stack.client.patch("/v1/admin/limits", headers=bearer(admin),
                              json={"keys": {"0123456789ab": {"rate_burst": None}}})
    assert gone.status_code == 200


def test_cross_tenant_batches_are_404(stack: Stack) -> None:
    key_a, key_b = stack.key(tenant_name()), stack.key(tenant_name())
    admin = stack.key(tenant_name(), ("admin",))
    created = stack.client.post("/v1/batches", json={"jobs": [JOB]}, headers=bearer(key_a))
    assert created.status_code == 202, created.text
    batch_id = created.json()["id"]
    for method, path in (
        ("GET", f"/v1/batches/{batch_id}"),
        ("GET", f"/v1/batches/{batch_id}/results"),
        ("POST", f"/v1/batches/{batch_id}/cancel"),
    ):
        assert_error(stack.client.request(method, path, headers=bearer(key_b)), 404, "batch_not_found")
    assert stack.client.get(f"/v1/batches/{batch_id}", headers=bearer(key_a)).status_code == 200
    assert stack.client.get(f"/v1/batches/{batch_id}", headers=bearer(admin)).status_code == 200
    # The batch's jobs are the owner's jobs: invisible to the other tenant's list.
    listed = stack.client.get("/v1/jobs", headers=bearer(key_b)).json()["items"]
    assert listed == []


def test_only_a_webhooks_or_admin_key_reads_or_rotates_the_webhook_secret(stack: Stack) -> None:
    """A submit-only key must neither read the tenant's signing secret (it could forge deliveries)
    nor rotate it (every receiver would break) (issue 31)."""
    tenant = tenant_name()
    submit_read = bearer(stack.key(tenant, ("submit", "read")))
    for method, path in (("GET", "/v1/webhooks/secret"), ("POST", "/v1/webhooks/secret/rotate")):
        assert_error(stack.client.request(method, path, headers=submit_read), 403, "forbidden")
    webhooks_key = bearer(stack.key(tenant, ("webhooks",)))
    first = stack.client.get("/v1/webhooks/secret", headers=webhooks_key)
    assert first.status_code == 200 and first.json()["tenant"] == tenant, first.text
    rotated = stack.client.post("/v1/webhooks/secret/rotate", headers=webhooks_key)
    assert rotated.status_code == 200 and rotated.json()["secret"] != first.json()["secret"]
    admin = stack.client.get("/v1/webhooks/secret", headers=bearer(stack.key(tenant, ("admin",))))
    assert admin.status_code == 200 and admin.json()["secret"] == rotated.json()["secret"]
