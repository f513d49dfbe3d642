"""The worker registry on a real Redis: a worker that stops beating stops being ready within one
heartbeat, long before its entry's TTL drops it from the listing (issue 16: ``/readyz`` counted a
SIGKILLed worker as ready until the TTL ran out)."""

from __future__ import annotations

import uuid

import pytest
import redis as redis_lib

from scheduler import redis_keys
from scheduler.workers import WorkerInfo, WorkerState, list_workers, publish_worker, ready_workers

pytestmark = pytest.mark.integration


def test_a_worker_that_stops_beating_leaves_readiness_before_its_ttl(redis_client: redis_lib.Redis) -> None:
    worker_id = f"cloverq-1@stale-{uuid.uuid4().hex[:8]}"
    info = WorkerInfo(id=worker_id, hostname="stale-host", pid=1, queues=["standard"],
                      state=WorkerState.READY, heartbeat_seconds=0.5)
    publish_worker(redis_client, info, ttl_seconds=30)
    try:
        assert worker_id in {w.id for w in ready_workers(redis_client)}
        # 1.6 s pass without a heartbeat (one 0.5 s interval + 1 s grace is 1.5 s): shown by
        # shortening the TTL left, which is how readers measure the age.
        redis_client.pexpire(redis_keys.worker(worker_id), 30_000 - 1_600)
        assert worker_id not in {w.id for w in ready_workers(redis_client)}
        (listed,) = [w for w in list_workers(redis_client) if w.id == worker_id]
        assert listed.state == WorkerState.READY and not listed.is_fresh  # still listed, not ready
        publish_worker(redis_client, info, ttl_seconds=30)  # it beats again: ready again
        assert worker_id in {w.id for w in ready_workers(redis_client)}
    finally:
        redis_client.delete(redis_keys.worker(worker_id))
        redis_client.srem(redis_keys.WORKERS_SET, worker_id)
