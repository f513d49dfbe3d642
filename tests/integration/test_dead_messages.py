"""Messages of jobs cancelled while queued neither count against the queue cap nor stay (issue 31).

After two cancelled 10k batches the bulk lists held ~20k dead messages: uploads got ``429
queue_full`` with six jobs queued in SQL, and workers spent minutes skipping them. Here, with no
worker running, a cancelled batch must free its share of the cap at once, the reconciler's purge
must leave only live messages in the lists, and a dead message a worker does get is recognised
without a claim.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient

from api.app import create_app
from scheduler.access.admission import queue_depths
from scheduler.fleet.operator_state import clear_operator_state
from scheduler.infra import redis_keys
from scheduler.infra.db import get_session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.dead_messages import purge_dead_messages, take_if_dead
from tests.conftest import clear_leftover_jobs

pytestmark = pytest.mark.integration

CAP = 50
BATCH = 40


@pytest.fixture
def stack(make_settings: Callable[..., Settings]) -> Iterator[tuple[Settings, TestClient]]:
    caps = {"interactive": 1000, "standard": 1000, "bulk": CAP, "joint": 100}
    # A fair-share window of a whole batch: every message is listed at once, as these tests count
    # (tests/integration/test_fairness_index.py covers held jobs, cancelled and counted).
    settings = make_settings(auth="disabled", queue_max_depth=caps, tenant_max_active_jobs=10_000,
                             fair_share_window=BATCH)
    clear_leftover_jobs(settings)
    with get_session_factory(settings.resolved_database_url)() as session:  # no leftover cap override
        clear_operator_state(session, redis_lib.Redis.from_url(settings.resolved_redis_url))
    with TestClient(create_app(settings)) as client:
        yield settings, client
    clear_leftover_jobs(settings)


def _batch(client: TestClient, tag: str) -> Any:
    jobs = [{"kind": "generate", "input": {"prompt": f"{tag} {i}"}, "params": {"max_new_tokens": 4}}
            for i in range(BATCH)]  # fmt: skip
    return client.post("/v1/batches", json={"jobs": jobs})


def test_a_cancelled_batch_frees_the_cap_at_once_and_its_messages_are_purged(
    stack: tuple[Settings, TestClient],
) -> None:
    settings, client = stack
    redis = redis_lib.Redis.from_url(settings.resolved_redis_url)
    first = _batch(client, "first")
    assert first.status_code == 202, first.text
    refused = _batch(client, "refused")
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"  # the cap holds
    assert client.post(f"/v1/batches/{first.json()['id']}/cancel").status_code == 200
    listed = sum(redis.llen(f"bulk{suffix}") for suffix in ("", "\x06\x163", "\x06\x166", "\x06\x169"))
    assert listed == BATCH and redis.zcard(redis_keys.dead_messages("bulk")) == BATCH  # still listed...
    assert queue_depths(redis, ["bulk"])["bulk"] == 0  # ...but no longer live depth
    second = _batch(client, "second")  # ...but no longer count: 0 live + 40 new fits the cap of 50
    assert second.status_code == 202, second.text
    lines = client.get(f"/v1/batches/{second.json()['id']}/results").text.splitlines()
    live = [json.loads(line)["job_id"] for line in lines]
    assert len(live) == BATCH
    assert purge_dead_messages(redis) == BATCH  # the reconciler's tick
    assert queue_depths(redis, ["bulk"])["bulk"] == BATCH
    assert redis.zcard(redis_keys.dead_messages("bulk")) == 0
    assert purge_dead_messages(redis) == 0  # idempotent
    assert not take_if_dead(redis, "bulk", live[0])  # a live job's message is claimed as usual


def test_a_worker_recognises_a_dead_message_without_a_claim(stack: tuple[Settings, TestClient]) -> None:
    settings, client = stack
    redis = redis_lib.Redis.from_url(settings.resolved_redis_url)
    job = client.post("/v1/jobs", json={"kind": "generate", "input": {"prompt": "x"},
                                        "params": {"max_new_tokens": 4}}).json()  # fmt: skip
    assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
    assert redis.get(redis_keys.enqueued(job["id"])) is None  # the cancel took the marker
    assert take_if_dead(redis, job["queue"], job["id"])  # the worker skips it: no gate, no SQL
    assert not take_if_dead(redis, job["queue"], job["id"])  # taken once


def test_dead_members_whose_messages_vanished_stop_lowering_the_depth(
    stack: tuple[Settings, TestClient],
) -> None:
    """Lists deleted without their dead set (an operator's DEL, a partial flush) left members that
    subtracted from every later depth, so the cap admitted past itself: a CI run of the test above
    accepted a second batch over the cap after an earlier module deleted the lists."""
    settings, client = stack
    redis = redis_lib.Redis.from_url(settings.resolved_redis_url)
    first = _batch(client, "vanish")
    assert client.post(f"/v1/batches/{first.json()['id']}/cancel").status_code == 200
    redis.delete(*(f"bulk{suffix}" for suffix in ("", "\x06\x163", "\x06\x166", "\x06\x169")))
    assert redis.zcard(redis_keys.dead_messages("bulk")) == BATCH
    assert purge_dead_messages(redis) == 0  # no message left to remove...
    assert redis.zcard(redis_keys.dead_messages("bulk")) == 0  # ...and no member left to subtract
    assert _batch(client, "fits").status_code == 202  # 40 live of a cap of 50
    refused = _batch(client, "over")  # 80 live: the cap holds again
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
