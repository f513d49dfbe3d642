"""Fair share's held index on real Redis and SQL, without a worker (scheduler/fairness/).

A "worker" here takes a message the way Celery's Redis transport does (the oldest from the
list's tail) and kicks a release pass, as a real worker's kicker does: the order in which
messages are taken is then the order fair share chose.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any, cast

import pytest
import redis as redis_lib

from scheduler.access.admission import queue_depths
from scheduler.batches.service import JobSpec, cancel_batch, create_batch, get_batch, publish_batch
from scheduler.fairness import gate
from scheduler.fairness.aging import fair_aging_candidates
from scheduler.fairness.held import held_count, is_held_marker
from scheduler.fleet.operator_state import clear_operator_state, update_limits
from scheduler.infra import redis_keys
from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.db import get_session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.dead_messages import job_id_of_message
from scheduler.jobs.models import Job, utcnow
from scheduler.jobs.service import cancel_job, submit_job
from scheduler.maintenance.tasks import enqueue_due_jobs
from tests.conftest import clear_leftover_jobs

pytestmark = pytest.mark.integration

WINDOW = 4
SPEC = JobSpec(kind="generate", input={"prompt": "x"}, params={"max_new_tokens": 4})


class Stack:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.redis = redis_lib.Redis.from_url(settings.resolved_redis_url)
        self.app = create_celery_app(settings)
        self.sessions = get_session_factory(settings.resolved_database_url)

    def batch(self, tenant: str, n: int) -> uuid.UUID:
        with self.sessions() as session:
            batch, jobs = create_batch(session, tenant=tenant, specs=[SPEC] * n, settings=self.settings)
        publish_batch(jobs, app=self.app, redis_client=self.redis, settings=self.settings,
                      sessions=self.sessions)
        return batch.id

    def listed(self) -> int:
        return int(self.redis.llen("bulk"))

    def take(self) -> str:
        """Take the next message like a worker (BRPOP: the list's tail) and kick a release."""
        raw = cast("bytes | None", self.redis.rpop("bulk"))
        assert raw is not None, "no message waiting"
        job_id = job_id_of_message(json.loads(raw))
        self.redis.delete(redis_keys.enqueued(job_id))  # the claim drops the marker
        gate.releaser(self.settings, self.app, self.redis).release("bulk")
        with self.sessions() as session:
            job = session.get(Job, job_id)
            assert job is not None
            return job.tenant


@pytest.fixture
def stack(make_settings: Callable[..., Any]) -> Iterator[Stack]:
    settings = make_settings(fair_share_window=WINDOW, tenant_max_active_jobs=10_000)
    clear_leftover_jobs(settings)
    stack = Stack(settings)
    with stack.sessions() as session:
        clear_operator_state(session, stack.redis)
    yield stack
    clear_leftover_jobs(settings)


def test_a_batch_fills_the_window_and_the_rest_is_held_and_counted(stack: Stack) -> None:
    stack.batch("ta", 30)
    assert stack.listed() == WINDOW
    assert held_count(stack.redis, "bulk") == 30 - WINDOW
    assert queue_depths(stack.redis, ["bulk"])["bulk"] == 30  # the depth cap still sees every job


def test_a_second_tenant_is_served_alternately_while_the_first_is_backlogged(stack: Stack) -> None:
    stack.batch("ta", 30)
    stack.batch("tb", 6)
    taken = [stack.take() for _ in range(WINDOW + 12)]
    assert taken[:WINDOW] == ["ta"] * WINDOW  # what the window held before tb came
    after = taken[WINDOW:]
    assert after.count("tb") == 6 and after.index("tb") <= 1  # at once, then every other message
    assert all(after[i] != after[i + 1] for i in range(10))


def test_weights_set_through_the_limits_share_three_to_one(stack: Stack) -> None:
    with stack.sessions() as session:
        update_limits(session, stack.redis, {"fair_weight:ta": 3.0})
    stack.batch("ta", 60)
    stack.batch("tb", 60)
    taken = [stack.take() for _ in range(WINDOW + 40)][WINDOW:]
    assert abs(taken.count("ta") - 30) <= 2, taken


def test_a_cancelled_held_batch_leaves_the_index_and_the_depth(stack: Stack) -> None:
    batch_id = stack.batch("ta", 20)
    with stack.sessions() as session:
        batch = get_batch(session, batch_id=batch_id, tenant=None)
        assert batch is not None
        cancel_batch(session, batch=batch, settings=stack.settings, redis_client=stack.redis)
    assert held_count(stack.redis, "bulk") == 0
    assert queue_depths(stack.redis, ["bulk"])["bulk"] == 0  # listed ones are dead, held ones gone


def test_the_reconciler_rebuilds_a_lost_index_without_doubling(stack: Stack) -> None:
    stack.batch("ta", 12)
    stack.redis.delete(*stack.redis.scan_iter(match=f"{redis_keys.PREFIX}:fair:*"))  # the index is lost
    with stack.sessions() as session:
        enqueue_due_jobs(session, app=stack.app, redis_client=stack.redis, settings=stack.settings,
                         now=_later())
    assert held_count(stack.redis, "bulk") == 12 - WINDOW  # the held markers' entries, back
    assert stack.listed() == WINDOW  # nothing published twice
    stack.redis.delete(*stack.redis.scan_iter(match=f"{redis_keys.PREFIX}:fair:*"))
    stack.redis.delete(*stack.redis.scan_iter(match=f"{redis_keys.PREFIX}:enqueued:*"))
    stack.redis.delete("bulk")  # Redis lost everything
    with stack.sessions() as session:
        enqueue_due_jobs(session, app=stack.app, redis_client=stack.redis, settings=stack.settings,
                         now=_later())
    assert stack.listed() == WINDOW and held_count(stack.redis, "bulk") == 12 - WINDOW
    markers = [stack.redis.get(key) for key in stack.redis.scan_iter(match=f"{redis_keys.PREFIX}:enqueued:*")]
    assert sum(is_held_marker(value) for value in markers) == 12 - WINDOW


def _later() -> datetime:
    return utcnow() + timedelta(seconds=10)  # past the reconciler's grace


def test_a_cancelled_held_job_leaves_the_index(stack: Stack) -> None:
    stack.batch("ta", WINDOW)  # the window is full: the next single job is held
    with stack.sessions() as session:
        job, _ = submit_job(session, tenant="tb", kind="generate", input={"prompt": "x"}, priority="bulk",
                            params={"max_new_tokens": 4}, settings=stack.settings, celery=stack.app,
                            redis_client=stack.redis)
    assert is_held_marker(stack.redis.get(redis_keys.enqueued(job.id)))
    assert held_count(stack.redis, job.queue) == 1
    with stack.sessions() as session:
        cancel_job(session, job_id=job.id, tenant="tb", settings=stack.settings, redis_client=stack.redis)
    assert held_count(stack.redis, job.queue) == 0
    assert stack.redis.get(redis_keys.enqueued(job.id)) is None  # no message, nothing counted dead
    assert stack.redis.zcard(redis_keys.dead_messages(job.queue)) == 0


def test_aging_promotes_each_tenants_oldest_in_turn(stack: Stack) -> None:
    stack.batch("ta", 12)
    stack.batch("tb", 3)
    with stack.sessions() as session:
        rows = fair_aging_candidates(session, sources=("bulk",), cutoff=_later(), room=4, weights={})
    assert [row.tenant for row in rows] == ["ta", "tb", "ta", "tb"]  # oldest-first would be all ta
