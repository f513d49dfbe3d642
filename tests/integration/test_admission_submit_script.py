"""``Admission.admit_job``: the submit path's one Redis script (rate limit + queue + marker),
run against a real Redis. Every refusal leaves no enqueued marker behind."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
import redis as redis_lib

from scheduler.admission import LIMITS_KEY, Admission, AdmissionRefused
from scheduler.keys import REVOKED_SET
from scheduler.settings import Settings

pytestmark = pytest.mark.integration


def _names() -> tuple[str, str, str]:
    tag = uuid.uuid4().hex[:10]
    return f"key{tag}", f"q{tag}", f"cloverq:enqueued:test-{tag}"


@pytest.fixture
def client(redis_url: str) -> redis_lib.Redis:
    return redis_lib.Redis.from_url(redis_url)


@pytest.fixture
def admission(client: redis_lib.Redis, make_settings: Callable[..., Settings]) -> Admission:
    return Admission(client, make_settings(rate_limit_per_second=100.0, rate_limit_burst=5,
                                           tenant_max_active_jobs=10))


def test_admitted_job_takes_a_token_and_sets_its_marker(
    admission: Admission, client: redis_lib.Redis
) -> None:
    key, queue, marker = _names()
    decision, marked = admission.admit_job(bucket=key, key_id=key, tenant="t", queue=queue,
                                           enqueued_marker=marker, active_jobs=0)
    assert decision.allowed and not decision.revoked and decision.remaining == 4
    assert marked and client.get(marker) == queue.encode()
    assert 0 < client.ttl(marker) <= 24 * 3600


def test_revoked_key_and_empty_bucket_stop_before_the_queue_rule(
    admission: Admission, client: redis_lib.Redis
) -> None:
    key, queue, marker = _names()
    client.sadd(REVOKED_SET, key)
    try:
        decision, marked = admission.admit_job(bucket=key, key_id=key, tenant="t", queue=queue,
                                               enqueued_marker=marker, active_jobs=0)
        assert decision.revoked and not marked and client.exists(marker) == 0
    finally:
        client.srem(REVOKED_SET, key)

    client.hset(LIMITS_KEY, mapping={f"rate_per_second:{key}": 0.01, f"rate_burst:{key}": 1})
    try:
        assert admission.admit_job(bucket=key, key_id=key, tenant="t", queue=queue, enqueued_marker=marker,
                                   active_jobs=0)[0].allowed
        client.delete(marker)
        decision, marked = admission.admit_job(bucket=key, key_id=key, tenant="t", queue=queue,
                                               enqueued_marker=marker, active_jobs=0)
        assert not decision.allowed and decision.retry_after_seconds >= 1
        assert not marked and client.exists(marker) == 0
    finally:
        client.hdel(LIMITS_KEY, f"rate_per_second:{key}", f"rate_burst:{key}")


def test_full_queue_and_tenant_cap_refuse_without_a_marker(
    admission: Admission, client: redis_lib.Redis
) -> None:
    key, queue, marker = _names()
    client.hset(LIMITS_KEY, f"queue_max_depth:{queue}", 1)
    client.lpush(queue, "waiting")
    try:
        with pytest.raises(AdmissionRefused) as full:
            admission.admit_job(bucket=key, key_id=key, tenant="t", queue=queue, enqueued_marker=marker,
                                active_jobs=0)
        assert full.value.code == "queue_full" and full.value.details["depth"] == 1
        assert client.exists(marker) == 0
    finally:
        client.hdel(LIMITS_KEY, f"queue_max_depth:{queue}")
        client.delete(queue)

    with pytest.raises(AdmissionRefused) as capped:  # the marker set by the script is removed again
        admission.admit_job(bucket=key, key_id=key, tenant="t", queue=queue, enqueued_marker=marker,
                            active_jobs=10)
    assert capped.value.code == "tenant_limit"
    assert client.exists(marker) == 0
