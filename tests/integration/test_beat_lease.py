"""The fenced leader lease of the beat (``scheduler/infra/leader_lease.py``) against a real Redis.

One holder at a time; renewing keeps it; a holder that stops renewing (dead or hung) stops
believing it holds on its own clock, the lease expires in Redis, another takes it with a higher
fencing number, and the stale holder can neither renew nor release the new holder's lease.
Short TTLs on keys of this test's own, so no beat process's lease is touched.
"""

from __future__ import annotations

import time
import uuid

import pytest
import redis as redis_lib

from scheduler.infra.leader_lease import FencedLease, parse_value

pytestmark = pytest.mark.integration

TTL = 0.5


def test_lease_acquire_renew_expire_fence_and_stale_holder(redis_client: redis_lib.Redis) -> None:
    key, fence_key = f"test:lease:{uuid.uuid4().hex}", f"test:fence:{uuid.uuid4().hex}"

    def lease(name: str) -> FencedLease:
        return FencedLease(redis_client, key=key, fence_key=fence_key, ttl_seconds=TTL, name=name)

    first, second = lease("first"), lease("second")
    try:
        assert first.acquire() and first.holds() and first.fence == 1 and first.valid_fence() == 1
        assert not second.acquire() and not second.holds() and second.fence is None  # one holder
        assert parse_value(redis_client.get(key)) is not None
        assert parse_value(redis_client.get(key)).name == "first"  # type: ignore[union-attr]

        for _ in range(3):  # renewing keeps it past its first TTL
            time.sleep(TTL / 3)
            assert first.renew() and first.holds()
        assert 0 < redis_client.pttl(key) <= TTL * 1000
        assert not second.acquire()

        time.sleep(TTL * 1.1)  # the holder hangs: no renew
        assert not first.holds()  # it stops on its own clock, before asking Redis
        assert first.valid_fence() is None and first.fence == 1  # the fence it may act on: none now
        assert redis_client.exists(key) == 0  # and the lease expired in Redis
        assert second.acquire() and second.holds()
        assert second.fence == 2  # a higher fencing number than any before

        assert not first.renew() and not first.holds()  # the stale holder cannot take it back
        assert not first.release()  # nor delete the new holder's lease
        assert parse_value(redis_client.get(key)) == parse_value(f"2 second {'x' * 16}")
        assert second.release() and redis_client.exists(key) == 0  # a clean stop hands over at once
        assert first.acquire() and first.fence == 3
    finally:
        redis_client.delete(key, fence_key)


def test_parse_value_rejects_foreign_values() -> None:
    assert parse_value(None) is None
    assert parse_value("not a lease") is None
    assert parse_value(b"7 host:12 abcd") == parse_value("7 host:12 efgh")
    with pytest.raises(ValueError):
        FencedLease(redis_lib.Redis(), key="k", fence_key="f", ttl_seconds=1, name="with space")
