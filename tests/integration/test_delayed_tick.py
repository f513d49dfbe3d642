"""The delayed tick and the filtered webhook sweep as functions, on both SQL backends and real Redis
(no worker): a delayed job gets no message before it is due, the tick publishes it once and moves
its cursor past it, the reconciler leaves it alone until then; the sweep skips a final status the
job's filter declines (its SQL is the one piece each backend must agree on)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from scheduler.infra import redis_keys
from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.db import get_session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job, JobStatus, utcnow
from scheduler.jobs.service import submit_job
from scheduler.maintenance.delayed import read_cursor, release_due_delayed
from scheduler.maintenance.tasks import enqueue_due_jobs
from scheduler.webhooks.tables import WebhookDelivery
from scheduler.webhooks.tasks import sweep

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(make_settings: Any, fresh_db_url: str) -> Settings:
    return make_settings(database_url=fresh_db_url, fair_share=False,  # fair share: scheduler/fairness tests
                         webhook_allowed_networks=["127.0.0.0/8"])


@pytest.fixture
def session(settings: Settings) -> Iterator[Session]:
    with get_session_factory(settings.resolved_database_url)() as s:
        yield s


@pytest.fixture
def client(settings: Settings) -> redis_lib.Redis:
    c = redis_lib.Redis.from_url(settings.resolved_redis_url, decode_responses=True)
    c.flushdb()
    return c


def _submit(session: Session, settings: Settings, client: redis_lib.Redis, **kw: Any) -> Job:
    job, _ = submit_job(session, tenant="t-" + uuid.uuid4().hex[:8], kind="generate", input={"prompt": "hi"},
                        params={"max_new_tokens": 4}, settings=settings, celery=create_celery_app(settings),
                        redis_client=client, **kw)
    return job


def test_tick_publishes_a_delayed_job_once_when_due(session: Session, settings: Settings,
                                                    client: redis_lib.Redis) -> None:
    app = create_celery_app(settings)
    due = utcnow() + timedelta(seconds=60)
    job = _submit(session, settings, client, scheduled_for=due)
    assert job.available_at == due and client.llen(job.queue) == 0
    assert not client.exists(redis_keys.enqueued(job.id))
    grace = timedelta(seconds=settings.beat.reconcile_grace_seconds)
    assert enqueue_due_jobs(session, app=app, redis_client=client, settings=settings, now=due - grace) == 0
    assert release_due_delayed(session, app=app, redis_client=client, settings=settings, now=due
                               - timedelta(seconds=1)) == 0
    assert release_due_delayed(session, app=app, redis_client=client, settings=settings, now=due) == 1
    assert client.llen(job.queue) == 1 and client.exists(redis_keys.enqueued(job.id))
    assert read_cursor(client) == (due, job.id)
    later = due + timedelta(seconds=1)
    assert release_due_delayed(session, app=app, redis_client=client, settings=settings, now=later) == 0
    client.delete(redis_keys.DELAYED_CURSOR, redis_keys.enqueued(job.id))  # Redis lost: look back again
    assert release_due_delayed(session, app=app, redis_client=client, settings=settings, now=later) == 1


def test_sweep_skips_a_final_status_the_filter_declines(session: Session, settings: Settings,
                                                       client: redis_lib.Redis) -> None:
    hook = "http://127.0.0.1:9/hook"
    declined = _submit(session, settings, client, webhook_url=hook, webhook_events="failed")
    wanted = _submit(session, settings, client, webhook_url=hook, webhook_events="started succeeded")
    default = _submit(session, settings, client, webhook_url=hook)
    session.execute(update(Job).where(Job.id.in_([declined.id, wanted.id, default.id]))
                    .values(status=JobStatus.SUCCEEDED.value, finished_at=utcnow()))
    session.commit()
    assert sweep(session, app=create_celery_app(settings), settings=settings) == 2
    recorded = set(session.scalars(select(WebhookDelivery.job_id)))
    assert recorded == {wanted.id, default.id}
