"""The submit path sets the job's enqueued marker inside the admission round trip.

The marker (``scheduler.infra.redis_keys.enqueued``) tells the reconciler a queued row has a message
in Redis. The API sets it with the admission script, before the row is inserted, so it must be
there for an accepted job and absent after anything that stores no job under that id.
"""

from __future__ import annotations

import pytest
import redis as redis_lib

from scheduler.infra import redis_keys
from tests.integration.test_security_api import JOB, Stack, bearer, make_stack, stack, tenant_name

__all__ = ["make_stack", "stack"]  # fixtures shared with the security tests

pytestmark = pytest.mark.integration

MARKERS = f"{redis_keys.PREFIX}:enqueued:*"


def _markers(redis_url: str) -> set[bytes]:
    return set(redis_lib.Redis.from_url(redis_url).scan_iter(match=MARKERS, count=1000))


def test_an_accepted_job_has_its_marker(stack: Stack, redis_url: str) -> None:
    response = stack.submit(stack.key(tenant_name()))
    assert response.status_code == 202
    job = response.json()
    marker = redis_lib.Redis.from_url(redis_url).get(redis_keys.enqueued(job["id"]))
    assert marker is not None and marker.decode() == job["queue"]


def test_a_refused_or_repeated_submit_leaves_no_marker(stack: Stack, redis_url: str) -> None:
    tenant = tenant_name()
    key, admin = stack.key(tenant), stack.key(tenant_name(), ("admin",))
    limits = {"tenants": {tenant: {"max_active": 1}}}
    stack.client.patch("/v1/admin/limits", headers=bearer(admin), json=limits)
    first = stack.submit(key, headers={"Idempotency-Key": "once"})
    assert first.status_code == 202
    before = _markers(redis_url)
    assert stack.submit(key).status_code == 429  # tenant cap: refused after the admission script ran
    again = stack.submit(key, headers={"Idempotency-Key": "once"})
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    other_body = {**JOB, "params": {"max_new_tokens": 9}}
    conflict = stack.submit(key, other_body, headers={"Idempotency-Key": "once"})
    assert conflict.status_code == 409
    assert _markers(redis_url) == before
