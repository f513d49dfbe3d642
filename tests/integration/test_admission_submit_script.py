"""``Admission.admit_job``: the submit path's one Redis script (rate limit + queue and tenant
reservations + marker), run against a real Redis. Every refusal leaves no enqueued marker and
no reservation behind."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
import redis as redis_lib

from scheduler.access.admission import Admission, AdmissionRefused, forget_admitted
from scheduler.infra import redis_keys
from scheduler.infra.redis_keys import LIMITS_KEY, REVOKED_SET
from scheduler.infra.settings import Settings

pytestmark = pytest.mark.integration


def _names() -> tuple[str, str, str]:
    tag = uuid.uuid4().hex[:10]
    return f"key{tag}", f"q{tag}", redis_keys.enqueued(f"test-{tag}")


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


def test_an_admitted_job_is_reserved_until_its_message_or_its_forgetting(
    admission: Admission, client: redis_lib.Redis
) -> None:
    """The reservation counts as depth (a second job does not fit a cap of 1 before the first
    one's message exists) and is dropped with the marker when the job is not stored after all."""
    key, queue, marker = _names()
    tenant = f"t-{queue}"
    client.hset(LIMITS_KEY, f"queue_max_depth:{queue}", 1)
    try:
        assert admission.admit_job(bucket=key, key_id=key, tenant=tenant, queue=queue, enqueued_marker=marker,
                                   active_jobs=0)[1]
        assert client.zscore(redis_keys.queue_reservations(queue), marker) is not None
        assert client.zscore(redis_keys.tenant_reservations(tenant), marker) is not None
        with pytest.raises(AdmissionRefused) as full:
            admission.admit_job(bucket=key, key_id=key, tenant=tenant, queue=queue,
                                enqueued_marker=marker + "-2", active_jobs=0)
        assert full.value.details == {"queue": queue, "depth": 1, "max_depth": 1}
        forget_admitted(client, tenant=tenant, marker=marker, queues=[queue])
        assert client.exists(marker) == 0
        assert client.zcard(redis_keys.queue_reservations(queue)) == 0
        assert client.zcard(redis_keys.tenant_reservations(tenant)) == 0
        assert admission.admit_job(bucket=key, key_id=key, tenant=tenant, queue=queue,
                                   enqueued_marker=marker + "-3", active_jobs=0)[1]
    finally:
        client.hdel(LIMITS_KEY, f"queue_max_depth:{queue}")
        client.delete(redis_keys.queue_reservations(queue), redis_keys.tenant_reservations(tenant))


def test_the_tenant_rule_counts_the_reservations_of_submits_in_flight(
    admission: Admission, client: redis_lib.Redis
) -> None:
    """Cap 10, 9 stored: of two jobs admitted before either is stored, the second is refused
    and leaves nothing behind (its reservation and marker removed)."""
    key, queue, marker = _names()
    tenant = f"t-{queue}"
    try:
        assert admission.admit_job(bucket=key, key_id=key, tenant=tenant, queue=queue, enqueued_marker=marker,
                                   active_jobs=lambda: 9)[1]
        with pytest.raises(AdmissionRefused) as capped:
            admission.admit_job(bucket=key, key_id=key, tenant=tenant, queue=queue,
                                enqueued_marker=marker + "-2", active_jobs=lambda: 9)
        assert capped.value.details == {"active_jobs": 10, "max_active_jobs": 10}
        assert client.exists(marker + "-2") == 0
        assert client.zrange(redis_keys.tenant_reservations(tenant), 0, -1) == [marker.encode()]
        assert client.zrange(redis_keys.queue_reservations(queue), 0, -1) == [marker.encode()]
    finally:
        client.delete(redis_keys.queue_reservations(queue), redis_keys.tenant_reservations(tenant), marker)
