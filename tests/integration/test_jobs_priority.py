"""Short jobs first, and long jobs never starve (aging), on a real one-slot worker.

The worker consumes ``interactive,standard,bulk`` in strict order with a single task thread
and an engine batch of one, so the order in which jobs START is the scheduling decision.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import update

from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.db import get_session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job, JobStatus
from scheduler.jobs.service import cancel_job, get_job, submit_job
from tests.conftest import ProcessLauncher, clear_leftover_jobs, wait_for

pytestmark = pytest.mark.integration

TENANT = "priority-tests"
AGING_SECONDS = 4.0
FEED_DEPTH = 8  # shorts kept waiting: deep enough that a stalled feeder thread never lets it drain
SHORT = {"max_new_tokens": 8, "steps_per_block": 2}  # cost 16 -> interactive
LONG = {"max_new_tokens": 64, "steps_per_block": 64}  # cost 4096 -> bulk


class Scheduler:
    def __init__(self, settings: Settings, client: redis_lib.Redis) -> None:
        self.settings = settings
        self.redis = client
        self.celery = create_celery_app(settings)
        self.sessions = get_session_factory(settings.resolved_database_url)

    def submit(self, params: dict[str, Any]) -> Job:
        with self.sessions() as session:
            job, _ = submit_job(session, tenant=TENANT, kind="generate", input={"prompt": "Once upon"},
                                params=params, settings=self.settings, celery=self.celery,
                                redis_client=self.redis)
        return job

    def get(self, job_id: uuid.UUID) -> Job:
        with self.sessions() as session:
            job = get_job(session, job_id=job_id, tenant=None)
        assert job is not None
        return job

    def wait(self, job_id: uuid.UUID, *statuses: str, timeout: float = 30.0) -> Job:
        return wait_for(lambda: (j := self.get(job_id)).status in statuses and j,
                        timeout=timeout, message=f"job {job_id} in {statuses}")

    def cancel(self, job_id: uuid.UUID) -> None:
        with self.sessions() as session:
            cancel_job(session, job_id=job_id, tenant=TENANT, settings=self.settings, redis_client=self.redis)


@pytest.fixture(scope="module")
def scheduler(
    make_settings: Any, demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Scheduler]:
    settings = make_settings(
        model_dir=demo_checkpoint, engine_max_batch=1, aging_seconds=AGING_SECONDS,
        interactive_max_cost=256, standard_max_cost=2048,
    )
    client = redis_lib.Redis.from_url(settings.resolved_redis_url, decode_responses=True)
    client.flushdb()
    clear_leftover_jobs(settings)  # else beat republishes what earlier modules left queued in SQL
    launcher = ProcessLauncher(tmp_path_factory.mktemp("priority-logs"))
    worker = launcher.start_worker(settings, queues="interactive,standard,bulk", concurrency=1,
                                   wait_ready=False)
    launcher.start_beat(settings)
    launcher.wait_ready(worker, settings, timeout=180)
    scheduler = Scheduler(settings, client)
    yield scheduler
    launcher.close()
    with scheduler.sessions() as session:  # the feeder's leftovers must not reach later modules
        session.execute(update(Job).where(Job.tenant == TENANT, Job.status == JobStatus.QUEUED.value)
                        .values(status=JobStatus.CANCELLED.value))
        session.commit()


def test_a_later_short_job_starts_before_a_backlog_of_long_jobs(scheduler: Scheduler) -> None:
    blocker = scheduler.submit({**SHORT, "fault": "stall_first_attempt"})  # holds the only slot
    scheduler.wait(blocker.id, JobStatus.RUNNING)
    longs = [scheduler.submit({**LONG, "seed": i}) for i in range(3)]
    assert {j.queue for j in longs} == {"bulk"}
    short = scheduler.submit(SHORT)
    assert short.queue == "interactive"
    scheduler.cancel(blocker.id)  # frees the slot: the next job the worker takes is the decision

    done_short = scheduler.wait(short.id, JobStatus.SUCCEEDED)
    done_longs = [scheduler.wait(j.id, JobStatus.SUCCEEDED) for j in longs]
    assert all(done_short.started_at < j.started_at for j in done_longs)
    assert done_short.created_at > max(j.created_at for j in done_longs)  # it was submitted last


def test_a_long_job_starts_within_its_aging_bound_under_a_stream_of_short_jobs(scheduler: Scheduler) -> None:
    stop = threading.Event()
    shorts: list[Job] = []

    def feed() -> None:  # keep the interactive queue non-empty: without aging, bulk would starve
        while not stop.is_set():
            if scheduler.redis.llen("interactive") < FEED_DEPTH:
                shorts.append(scheduler.submit(SHORT))
            else:
                time.sleep(0.01)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        wait_for(lambda: scheduler.redis.llen("interactive") >= FEED_DEPTH - 1, timeout=10,
                 message="a short backlog")
        long = scheduler.submit(LONG)
        assert long.queue == "bulk"
        s = scheduler.settings
        bound = AGING_SECONDS + s.beat.reconcile_interval_seconds + 5.0  # aging + beat tick + a few shorts
        started = scheduler.wait(long.id, JobStatus.RUNNING, JobStatus.SUCCEEDED, timeout=bound + 10)
    finally:
        stop.set()
        feeder.join(timeout=5)
    waited = (started.started_at - long.created_at).total_seconds()
    assert waited <= bound
    assert started.queue == "interactive"  # it got there by being promoted
    overtakers = [j for j in (scheduler.get(x.id) for x in shorts)
                  if j.started_at and long.created_at < j.created_at and j.started_at < started.started_at]
    assert overtakers, "shorts submitted after the long job should have run while it waited"
    assert waited >= AGING_SECONDS - 0.5  # it really waited for aging, not for a gap in the stream
