"""Readiness answers within its deadline and notices a dead worker within one heartbeat (issue 16).

No servers: the database check is a session factory that blocks, Redis a stub that refuses. The
registry's side (a stale entry on a real Redis) is in ``tests/integration/test_api_readiness.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.drain import ApiDrain
from api.routes import health
from scheduler.fleet.workers import WorkerInfo, WorkerState, heartbeat_age, stale_after
from scheduler.infra.settings import Settings


class _RefusingRedis:
    def ping(self) -> bool:
        raise redis.ConnectionError("refused")


def test_readyz_answers_503_within_its_deadline_while_the_database_hangs() -> None:
    release = threading.Event()

    @contextmanager
    def hanging_session() -> Iterator[Any]:
        release.wait(10)  # a connect that never completes
        yield None

    app = FastAPI()
    app.include_router(health.router)
    app.state.settings = Settings(readiness_timeout_seconds=0.3)
    app.state.session_factory = hanging_session
    app.state.redis = _RefusingRedis()
    app.state.drain = ApiDrain(0.0)  # create_app gives every app one (a replica that is not stopping)
    try:
        with TestClient(app) as client:
            started = time.monotonic()
            response = client.get("/readyz")
            assert time.monotonic() - started < 2.0
    finally:
        release.set()
    assert response.status_code == 503
    assert response.json() == {
        "ready": False,
        "checks": {"database": {"ok": False, "detail": "no answer within 0.3s"},
                   "redis": {"ok": False, "detail": "ConnectionError"},
                   "workers": {"ok": False, "detail": "redis unreachable"},
                   "consumers": {"ok": False, "detail": "redis unreachable"}},
        "ready_workers": {},
    }


def test_heartbeat_age_is_measured_on_redis_clock() -> None:
    assert heartbeat_age(8, 6_500) == 1.5  # TTL set 8 s, 6.5 s left: refreshed 1.5 s ago
    assert heartbeat_age(None, 6_500) is None  # an entry from before heartbeat_ttl was stored
    assert heartbeat_age(8, -1) is None  # no TTL on the key


def test_a_worker_that_missed_its_heartbeat_is_not_ready() -> None:
    def worker(age: float | None, interval: float = 2.0) -> WorkerInfo:
        return WorkerInfo(id="w", hostname="h", pid=1, queues=["standard"], state=WorkerState.READY,
                          heartbeat_seconds=interval, heartbeat_age=age)

    assert stale_after(2.0) == 3.0 and stale_after(0.5) == 1.5  # one interval + max(1 s, half)
    assert worker(2.9).is_ready
    assert not worker(3.1).is_ready  # its next beat is overdue: dead or wedged
    assert worker(None).is_ready and worker(60, interval=0).is_ready  # unknown: only the TTL drops it
    assert not WorkerInfo(id="w", hostname="h", pid=1, queues=[], state=WorkerState.DRAINING).is_ready

