"""The worker registry on a real Redis: a worker that stops beating stops being ready within one
heartbeat, long before its entry's TTL drops it from the listing (issue 16: ``/readyz`` counted a
SIGKILLed worker as ready until the TTL ran out)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient

from api.app import create_app
from scheduler.fleet.workers import WorkerInfo, WorkerState, list_workers, publish_worker, ready_workers
from scheduler.infra import redis_keys
from scheduler.infra.settings import Settings

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


def test_a_ready_worker_off_one_of_its_queues_fails_readiness_and_counts_in_metrics(
    make_settings: Callable[..., Settings], redis_client: redis_lib.Redis,
) -> None:
    """Issue 31 (1): a worker whose consumer read-back lacks a queue its state says it consumes is
    not ready for that queue: ``/readyz`` answers 503 naming the worker and queue, the per-queue
    ready count leaves the queue out, and ``cloverq_workers_queue_unconsumed`` counts it."""
    worker_id = f"cloverq-1@off-{uuid.uuid4().hex[:8]}"
    info = WorkerInfo(id=worker_id, hostname="off-host", pid=1, queues=["interactive", "bulk"],
                      state=WorkerState.READY, heartbeat_seconds=30,
                      stats={"consuming": ["interactive"], "unconsumed": ["bulk"]})
    publish_worker(redis_client, info, ttl_seconds=60)
    try:
        with TestClient(create_app(make_settings(auth="disabled"))) as client:
            readiness = client.get("/readyz")
            exposition = client.get("/metrics").text
    finally:
        redis_client.delete(redis_keys.worker(worker_id))
        redis_client.srem(redis_keys.WORKERS_SET, worker_id)
    assert readiness.status_code == 503
    body = readiness.json()
    assert body["ready"] is False
    assert body["checks"]["workers"]["ok"] is True  # it beats: ready as a process
    assert body["checks"]["consumers"] == {"ok": False, "detail": f"{worker_id} not consuming bulk"}
    assert body["ready_workers"].get("interactive", 0) >= 1
    unconsumed = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
                  for line in exposition.splitlines()
                  if line.startswith("cloverq_workers_queue_unconsumed{")}
    assert unconsumed, "the unconsumed gauge is exported"
    assert unconsumed['queue="bulk"'] >= 1
    assert unconsumed['queue="interactive"'] == 0
