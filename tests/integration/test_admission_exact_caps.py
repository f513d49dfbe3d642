"""Exact admission over HTTP on the real app, real database and real Redis (issue 15, item 2).

A queue's depth cap and a tenant's cap are checked and reserved in one atomic step, so
concurrent submits never admit past them; a batch is checked against the queues its jobs are
stored in (``bulk``), not the queue each job would get alone. No worker runs: every admitted
job's message stays in its list. The tests run on a Redis database of their own (flushed), so
the depth of a queue is exactly what they put there.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.app import create_app
from scheduler.access.admission import queue_depths
from scheduler.access.api_keys import create_key
from scheduler.infra import redis_keys
from scheduler.infra.db import make_engine, session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job

pytestmark = pytest.mark.integration

SHORT = {"kind": "generate", "input": {"prompt": "The contract says"}, "params": {"max_new_tokens": 8}}
QUEUES = ("interactive", "standard", "bulk", "joint")


@pytest.fixture
def own_redis_url(redis_url: str) -> Iterator[str]:
    """The session's Redis server, database 11, empty before and after the test."""
    parts = urlsplit(redis_url)
    url = urlunsplit((parts.scheme, parts.netloc, "/11", parts.query, parts.fragment))
    client = redis_lib.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()


class Stack:
    def __init__(self, settings: Settings, client: TestClient, redis_url: str) -> None:
        self.settings = settings
        self.client = client
        self.redis = redis_lib.Redis.from_url(redis_url)
        self.sessions = session_factory(make_engine(settings.resolved_database_url))
        self.tenant = f"t{uuid.uuid4().hex[:10]}"
        with self.sessions() as session:
            self.key = create_key(session, tenant=self.tenant, scopes=("submit", "read")).key

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self.client.post(path, json=body, headers={"Authorization": f"Bearer {self.key}"})

    def stored(self) -> Counter[str]:
        with self.sessions() as session:
            rows = session.execute(
                select(Job.queue, func.count()).where(Job.tenant == self.tenant).group_by(Job.queue)
            ).all()
        return Counter({queue: int(n) for queue, n in rows})

    def depths(self) -> dict[str, int]:
        return queue_depths(self.redis, QUEUES)

    def reservations(self) -> int:
        keys = [redis_keys.queue_reservations(q) for q in QUEUES]
        keys.append(redis_keys.tenant_reservations(self.tenant))
        return sum(int(self.redis.zcard(key)) for key in keys)

    def fill(self, queue: str, count: int) -> None:
        """``count`` stand-in messages waiting in ``queue`` (nothing consumes them here)."""
        if count:
            self.redis.lpush(queue, *(f"waiting-{i}" for i in range(count)))


@pytest.fixture
def make_stack(make_settings: Callable[..., Settings], own_redis_url: str) -> Iterator[Callable[..., Stack]]:
    clients: list[TestClient] = []

    def build(**overrides: Any) -> Stack:
        settings = make_settings(redis_url=own_redis_url, rate_limit_per_second=0.0, **overrides)
        client = TestClient(create_app(settings))
        client.__enter__()
        clients.append(client)
        return Stack(settings, client, own_redis_url)

    yield build
    for client in clients:
        client.__exit__(None, None, None)


def _burst(stack: Stack, count: int, body: dict[str, Any], path: str = "/v1/jobs") -> Counter[Any]:
    """``count`` submits at once from 32 threads; the tally of (status, error code)."""
    def one(_: int) -> tuple[int, str | None]:
        response = stack.post(path, body)
        code = response.json()["error"]["code"] if response.status_code >= 400 else None
        return response.status_code, code

    with ThreadPoolExecutor(max_workers=32) as pool:
        return Counter(pool.map(one, range(count)))


def test_200_concurrent_submits_against_a_queue_cap_of_30_admit_exactly_30(
    make_stack: Callable[..., Stack],
) -> None:
    caps = {"interactive": 30, "standard": 5000, "bulk": 20000, "joint": 500}
    stack = make_stack(queue_max_depth=caps, tenant_max_active_jobs=100_000)
    tally = _burst(stack, 200, SHORT)
    assert tally == {(202, None): 30, (429, "queue_full"): 170}, tally
    assert stack.stored() == {"interactive": 30}
    assert stack.depths()["interactive"] == 30  # every admitted job's message, and no other
    assert stack.reservations() == 0  # each message released its reservations


def test_200_concurrent_submits_never_pass_a_tenant_cap_of_30(make_stack: Callable[..., Stack]) -> None:
    stack = make_stack(tenant_max_active_jobs=30)
    tally = _burst(stack, 200, SHORT)
    admitted = tally[(202, None)]
    assert 0 < admitted <= 30 and admitted + tally[(429, "tenant_limit")] == 200, tally
    assert stack.stored() == {"interactive": admitted}
    assert stack.reservations() == 0
    # Refusals under contention are transient: one by one the tenant fills up to exactly 30.
    while stack.post("/v1/jobs", SHORT).status_code == 202:
        assert sum(stack.stored().values()) <= 30
    assert stack.stored() == {"interactive": 30}


def test_a_batch_is_refused_by_the_bulk_queue_at_its_cap(make_stack: Callable[..., Stack]) -> None:
    caps = {"interactive": 1000, "standard": 5000, "bulk": 5, "joint": 500}
    stack = make_stack(queue_max_depth=caps, tenant_max_active_jobs=100_000)
    stack.fill("bulk", 5)
    refused = stack.post("/v1/batches", {"jobs": [SHORT]})  # alone it would be interactive work
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "queue_full"
    assert error["details"] == {"queue": "bulk", "depth": 5, "max_depth": 5,
                                "setting": "CLOVERQ_QUEUE_MAX_DEPTH"}
    assert stack.stored() == {} and stack.reservations() == 0


def test_interactive_at_its_cap_does_not_refuse_a_bulk_batch(make_stack: Callable[..., Stack]) -> None:
    caps = {"interactive": 3, "standard": 5000, "bulk": 10, "joint": 500}
    stack = make_stack(queue_max_depth=caps, tenant_max_active_jobs=100_000)
    stack.fill("interactive", 3)
    assert stack.post("/v1/jobs", SHORT).json()["error"]["code"] == "queue_full"  # interactive is full
    accepted = stack.post("/v1/batches", {"jobs": [SHORT] * 4})
    assert accepted.status_code == 202, accepted.text
    assert stack.stored() == {"bulk": 4}
    assert stack.depths() == {"interactive": 3, "standard": 0, "bulk": 4, "joint": 0}
    # The batch's jobs count against bulk: 6 more fit its cap of 10, 7 do not.
    assert stack.post("/v1/batches", {"jobs": [SHORT] * 7}).json()["error"]["details"] == {
        "queue": "bulk", "depth": 4, "max_depth": 10, "setting": "CLOVERQ_QUEUE_MAX_DEPTH"}
    assert stack.post("/v1/batches", {"jobs": [SHORT] * 6}).status_code == 202
    assert stack.stored() == {"bulk": 10} and stack.depths()["bulk"] == 10
    assert stack.reservations() == 0


def test_concurrent_batches_fill_the_bulk_queue_exactly(make_stack: Callable[..., Stack]) -> None:
    caps = {"interactive": 1000, "standard": 5000, "bulk": 30, "joint": 500}
    stack = make_stack(queue_max_depth=caps, tenant_max_active_jobs=100_000)
    tally = _burst(stack, 40, {"jobs": [SHORT] * 5}, path="/v1/batches")
    assert tally == {(202, None): 6, (429, "queue_full"): 34}, tally
    assert stack.stored() == {"bulk": 30} and stack.depths()["bulk"] == 30
    assert stack.reservations() == 0
