"""The job domain's functions on real databases (SQLite and PostgreSQL) and real Redis, no worker:
listing and cursors, tenancy, idempotency, fenced claim/finish, retries, reaper, expiry,
reconciler and aging."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import update
from sqlalchemy.orm import Session

from scheduler.infra import redis_keys
from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.db import get_session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.lifecycle import Lease, claim_job, finish_job, renew_leases, retry_or_fail
from scheduler.jobs.models import Job, JobStatus, utcnow
from scheduler.jobs.service import (
    IdempotencyConflictError,
    InvalidCursorError,
    cancel_job,
    get_job,
    list_jobs,
    submit_job,
)
from scheduler.maintenance.tasks import (
    enqueue_due_jobs,
    expire_finished_jobs,
    promote_aged_jobs,
    reap_expired_leases,
)
from tests.conftest import clear_leftover_jobs

pytestmark = pytest.mark.integration

PARAMS = {"max_new_tokens": 8, "steps_per_block": 2}


@pytest.fixture
def settings(make_settings: Any, db_backend_url: str) -> Settings:
    return make_settings(database_url=db_backend_url, max_attempts=2)


@pytest.fixture
def session(settings: Settings) -> Iterator[Session]:
    with get_session_factory(settings.resolved_database_url)() as s:
        yield s


@pytest.fixture
def client(settings: Settings) -> redis_lib.Redis:
    c = redis_lib.Redis.from_url(settings.resolved_redis_url, decode_responses=True)
    c.flushdb()
    return c


@pytest.fixture
def celery(settings: Settings) -> Any:
    return create_celery_app(settings)


def submit(session: Session, settings: Settings, client: redis_lib.Redis, celery: Any, **kw: Any) -> Job:
    kw.setdefault("tenant", "t-" + uuid.uuid4().hex[:8])
    kw.setdefault("kind", "generate")
    kw.setdefault("input", {"prompt": "hi"})
    kw.setdefault("params", PARAMS)
    job, _ = submit_job(session, settings=settings, celery=celery, redis_client=client, **kw)
    CREATED.append(job.id)
    return job


CREATED: list[uuid.UUID] = []


@pytest.fixture(autouse=True)
def cancel_leftovers(session: Session) -> Iterator[None]:
    """Jobs these tests leave queued are cancelled, so they never reach later tests' workers."""
    yield
    if CREATED:
        session.rollback()
        session.execute(update(Job).where(Job.id.in_(CREATED), Job.status == JobStatus.QUEUED.value)
                        .values(status=JobStatus.CANCELLED.value))
        session.commit()
        CREATED.clear()


def test_list_is_newest_first_with_a_stable_keyset_cursor_and_filters(
    session: Session, settings: Settings, client: redis_lib.Redis, celery: Any
) -> None:
    tenant = "lister-" + uuid.uuid4().hex[:6]
    made = [submit(session, settings, client, celery, tenant=tenant, publish=False) for _ in range(7)]
    long = submit(session, settings, client, celery, tenant=tenant, publish=False,
                  params={"max_new_tokens": 4096, "steps_per_block": 64})
    seen: list[uuid.UUID] = []
    cursor = None
    while True:
        page, cursor = list_jobs(session, tenant=tenant, cursor=cursor, limit=3)
        seen += [j.id for j in page]
        if cursor is None:
            break
    assert len(seen) == len(set(seen)) == 8
    assert seen == [j.id for j in sorted([*made, long], key=lambda j: (j.created_at, j.id), reverse=True)]
    bulk, _ = list_jobs(session, tenant=tenant, queue="bulk")
    assert [j.id for j in bulk] == [long.id]
    assert list_jobs(session, tenant=tenant, status="running")[0] == []
    after, _ = list_jobs(session, tenant=tenant, created_after=made[3].created_at, limit=100)
    assert {j.id for j in after} >= {j.id for j in made[4:]}
    assert list_jobs(session, tenant="someone-else")[0] == []
    with pytest.raises(InvalidCursorError):
        list_jobs(session, tenant=tenant, cursor="not-a-cursor")


def test_tenants_cannot_see_or_cancel_each_others_jobs(
    session: Session, settings: Settings, client: redis_lib.Redis, celery: Any
) -> None:
    job = submit(session, settings, client, celery, tenant="alice", publish=False)
    assert get_job(session, job_id=job.id, tenant="bob") is None
    assert cancel_job(session, job_id=job.id, tenant="bob", settings=settings, redis_client=client) is None
    assert get_job(session, job_id=job.id, tenant="alice") is not None
    assert get_job(session, job_id=str(job.id), tenant=None) is not None  # admin
    assert get_job(session, job_id="not-a-uuid", tenant=None) is None


def test_idempotency_key_reuse_with_a_different_body_conflicts(
    session: Session, settings: Settings, client: redis_lib.Redis, celery: Any
) -> None:
    key = uuid.uuid4().hex
    job = submit(session, settings, client, celery, tenant="idem", idempotency_key=key, publish=False)
    with pytest.raises(IdempotencyConflictError) as err:
        submit(session, settings, client, celery, tenant="idem", idempotency_key=key, publish=False,
               input={"prompt": "something else"})
    assert err.value.job.id == job.id


def test_submit_publishes_a_message_with_the_id_only_and_sets_the_marker(
    session: Session, settings: Settings, client: redis_lib.Redis, celery: Any
) -> None:
    job = submit(session, settings, client, celery)
    assert client.llen(job.queue) == 1
    assert client.exists(redis_keys.enqueued(job.id))
    assert str(job.id) in client.lindex(job.queue, 0)


def test_a_failed_publish_leaves_the_row_queued_for_the_reconciler(
    session: Session, settings: Settings, client: redis_lib.Redis, celery: Any, make_settings: Any
) -> None:
    dead = make_settings(database_url=settings.database.url, redis_url="redis://127.0.0.1:1/0")
    job, created = submit_job(session, tenant="t", kind="generate", input={"prompt": "x"}, params=PARAMS,
                              settings=dead, celery=create_celery_app(dead), redis_client=client)
    CREATED.append(job.id)
    assert created and get_job(session, job_id=job.id, tenant=None).status == JobStatus.QUEUED
    assert client.llen(job.queue) == 0
    later = utcnow() + timedelta(seconds=settings.beat.reconcile_grace_seconds + 1)
    assert enqueue_due_jobs(session, app=celery, redis_client=client, settings=settings, now=later) >= 1
    assert client.llen(job.queue) >= 1
    # a second tick publishes nothing new: the marker says the message exists
    before = client.llen(job.queue)
    enqueue_due_jobs(session, app=celery, redis_client=client, settings=settings, now=later)
    assert client.llen(job.queue) == before


def test_claim_and_finish_are_fenced_by_attempt(
    session: Session, settings: Settings, client: redis_lib.Redis, celery: Any
) -> None:
    job = submit(session, settings, client, celery, publish=False)
    first = claim_job(session, job_id=job.id, worker_id="w1", model_version="m", settings=settings)
    assert first is not None and first.attempt == 1 and first.status == JobStatus.RUNNING
    assert claim_job(session, job_id=job.id, worker_id="w2", model_version="m", settings=settings) is None
    # the attempt fails transiently and is claimed again elsewhere: the old attempt can no longer write
    assert retry_or_fail(session, lease=Lease(job.id, 1), error="oom", settings=settings) == JobStatus.QUEUED
    due = utcnow() + timedelta(seconds=settings.jobs.retry_backoff_max_seconds + 1)
    second = claim_job(session, job_id=job.id, worker_id="w2", model_version="m", settings=settings, now=due)
    assert second is not None and second.attempt == 2
    assert not finish_job(session, lease=Lease(job.id, 1), status=JobStatus.SUCCEEDED, settings=settings,
                          result={"text": "stale"})
    check = renew_leases(session, leases=[Lease(job.id, 1)], worker_id="w1", settings=settings)
    assert check.lost == {job.id}
    assert finish_job(session, lease=Lease(job.id, 2), status=JobStatus.SUCCEEDED, settings=settings,
                      result={"text": "ok"})
    assert not finish_job(session, lease=Lease(job.id, 2), status=JobStatus.FAILED, settings=settings)
    final = get_job(session, job_id=job.id, tenant=None)
    assert final.status == JobStatus.SUCCEEDED and final.result == {"text": "ok"} and final.attempt == 2


def test_retries_stop_at_max_attempts(
    session: Session, settings: Settings, client: redis_lib.Redis, celery: Any
) -> None:
    job = submit(session, settings, client, celery, publish=False)
    now = utcnow()
    for attempt in range(1, settings.jobs.max_attempts + 1):
        now += timedelta(seconds=settings.jobs.retry_backoff_max_seconds + 1)
        assert claim_job(session, job_id=job.id, worker_id="w", model_version=None, settings=settings,
                         now=now)
        status = retry_or_fail(session, lease=Lease(job.id, attempt), error="boom", settings=settings,
                               now=now)
    assert status == JobStatus.FAILED
    final = get_job(session, job_id=job.id, tenant=None)
    assert final.error_code == "retries_exhausted" and final.attempt == settings.jobs.max_attempts


def test_reaper_requeues_then_fails_jobs_whose_lease_expired(
    session: Session, settings: Settings, client: redis_lib.Redis, celery: Any
) -> None:
    job = submit(session, settings, client, celery, publish=False)
    assert claim_job(session, job_id=job.id, worker_id="dead", model_version=None, settings=settings)
    assert reap_expired_leases(session, redis_client=client, settings=settings).requeued == 0  # still leased
    after_lease = utcnow() + timedelta(seconds=settings.jobs.lease_seconds + 1)
    assert reap_expired_leases(session, redis_client=client, settings=settings, now=after_lease).requeued == 1
    assert get_job(session, job_id=job.id, tenant=None).status == JobStatus.QUEUED
    later = after_lease + timedelta(seconds=settings.jobs.retry_backoff_max_seconds + 1)
    assert claim_job(session, job_id=job.id, worker_id="dead2", model_version=None, settings=settings,
                     now=later)
    last = later + timedelta(seconds=settings.jobs.lease_seconds + 1)
    assert reap_expired_leases(session, redis_client=client, settings=settings, now=last).failed == 1
    final = get_job(session, job_id=job.id, tenant=None)
    assert final.status == JobStatus.FAILED and final.error_code == "retries_exhausted"


def test_expiry_drops_payloads_of_old_finished_jobs(
    session: Session, settings: Settings, client: redis_lib.Redis, celery: Any
) -> None:
    job = submit(session, settings, client, celery, publish=False)
    claim_job(session, job_id=job.id, worker_id="w", model_version=None, settings=settings)
    finish_job(session, lease=Lease(job.id, 1), status=JobStatus.SUCCEEDED, settings=settings,
               result={"text": "x"})
    assert expire_finished_jobs(session) == 0 or get_job(session, job_id=job.id, tenant=None).status \
        == JobStatus.SUCCEEDED
    future = utcnow() + timedelta(seconds=settings.jobs.result_ttl_seconds + 1)
    assert expire_finished_jobs(session, now=future) >= 1
    final = get_job(session, job_id=job.id, tenant=None)
    assert final.status == JobStatus.EXPIRED and final.result is None and final.input is None


@pytest.fixture
def own_database(db_backend_url: str, tmp_path: Any) -> Iterator[str]:
    """A fresh, migrated database of the same backend as ``db_backend_url``, for tests whose
    subject is global over the table (aging promotes the oldest queued jobs of every tenant, so
    jobs other tests left queued would be promoted first)."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from scheduler.infra.db import migrate

    if db_backend_url.startswith("sqlite"):
        url = f"sqlite:///{tmp_path / 'own.db'}"
        migrate(url)
        yield url
        return
    admin = create_engine(db_backend_url, isolation_level="AUTOCOMMIT")
    name = f"cloverq_own_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = make_url(db_backend_url).set(database=name).render_as_string(hide_password=False)
    try:
        migrate(url)
        yield url
    finally:
        get_session_factory(url).kw["bind"].dispose()
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def test_aging_promotes_long_waiting_jobs_to_interactive(
    own_database: str, make_settings: Any, client: redis_lib.Redis, celery: Any
) -> None:
    settings = make_settings(database_url=own_database, max_attempts=2)
    with get_session_factory(own_database)() as session:
        _check_aging(session, settings, client, celery)


def _check_aging(session: Session, settings: Settings, client: redis_lib.Redis, celery: Any) -> None:
    job = submit(session, settings, client, celery,
                 params={"max_new_tokens": 4096, "steps_per_block": 64})
    assert job.queue == "bulk"
    assert promote_aged_jobs(session, app=celery, redis_client=client, settings=settings) == 0
    later = utcnow() + timedelta(seconds=settings.scheduling.aging_seconds + 1)
    assert promote_aged_jobs(session, app=celery, redis_client=client, settings=settings, now=later) >= 1
    promoted = get_job(session, job_id=job.id, tenant=None)
    assert promoted.queue == "interactive" and promoted.priority == "bulk"
    assert any(str(job.id) in m for m in client.lrange("interactive", 0, -1))


def test_cancel_running_sets_the_flag_and_the_redis_signal(
    session: Session, settings: Settings, client: redis_lib.Redis, celery: Any
) -> None:
    job = submit(session, settings, client, celery, publish=False)
    claim_job(session, job_id=job.id, worker_id="w", model_version=None, settings=settings)
    flagged = cancel_job(session, job_id=job.id, tenant=job.tenant, settings=settings, redis_client=client)
    assert flagged.status == JobStatus.RUNNING and flagged.cancel_requested
    assert client.exists(redis_keys.cancel(job.id))
    check = renew_leases(session, leases=[Lease(job.id, 1)], worker_id="w", settings=settings)
    assert check.cancel_requested == {job.id} and not check.lost
    expired = utcnow() - timedelta(seconds=1)
    session.execute(update(Job).where(Job.id == job.id).values(lease_deadline=expired))
    session.commit()
    assert reap_expired_leases(session, redis_client=client, settings=settings).cancelled == 1


def test_aging_promotes_oldest_first_and_caps_promoted_jobs_waiting(
    fresh_db_url: str, client: redis_lib.Redis, celery: Any, make_settings: Any
) -> None:
    # The cap counts every promoted job still waiting, so this runs on a database of its own.
    capped = make_settings(database_url=fresh_db_url, max_attempts=2, aging_max_promoted=2)
    with get_session_factory(fresh_db_url)() as session:
        jobs = [submit(session, capped, client, celery, publish=False,
                       params={"max_new_tokens": 4096, "steps_per_block": 64}) for _ in range(3)]
        later = utcnow() + timedelta(seconds=capped.scheduling.aging_seconds + 1)
        assert promote_aged_jobs(session, app=celery, redis_client=client, settings=capped, now=later) == 2
        queues = [get_job(session, job_id=j.id, tenant=None).queue for j in jobs]
        assert queues == ["interactive", "interactive", "bulk"]  # the two oldest
        assert promote_aged_jobs(session, app=celery, redis_client=client, settings=capped, now=later) == 0
        claim_job(session, job_id=jobs[0].id, worker_id="w", model_version=None, settings=capped, now=later)
        assert promote_aged_jobs(session, app=celery, redis_client=client, settings=capped, now=later) == 1
        assert get_job(session, job_id=jobs[2].id, tenant=None).queue == "interactive"


def test_redis_outage_degrades_cancel_and_progress_instead_of_failing(
    session: Session, settings: Settings, client: redis_lib.Redis, celery: Any
) -> None:
    from scheduler.jobs.service import read_progress

    dead = redis_lib.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    job = submit(session, settings, client, celery, publish=False)
    claim_job(session, job_id=job.id, worker_id="w", model_version=None, settings=settings)
    flagged = cancel_job(session, job_id=job.id, tenant=job.tenant, settings=settings, redis_client=dead)
    assert flagged is not None and flagged.cancel_requested  # the worker sees it at lease renewal
    assert read_progress(job.id, redis_client=dead) is None


def test_the_reconciler_pages_past_rows_whose_messages_exist(
    session: Session, settings: Settings, client: redis_lib.Redis, celery: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Held fair-share jobs stay queued rows without messages, so the oldest page of due rows can be
    all of them for a long time; a newer row whose message was lost must still be republished. With
    pages of 3 rows: six rows whose markers say a message exists, then one without: each tick reads
    the next page, and the seventh is reached (the scan used to read the oldest page every tick)."""
    from scheduler.maintenance import tasks as maintenance

    clear_leftover_jobs(settings)
    plain = settings.replaced(fair_share=False)
    monkeypatch.setattr(maintenance, "BATCH", 3)
    marked = [submit(session, plain, client, celery, publish=False) for _ in range(6)]
    for job in marked:
        client.set(redis_keys.enqueued(job.id), job.queue)
    lost = submit(session, plain, client, celery, publish=False)
    later = utcnow() + timedelta(seconds=settings.beat.reconcile_grace_seconds + 1)
    for _ in range(4):
        enqueue_due_jobs(session, app=celery, redis_client=client, settings=plain, now=later)
        if client.get(redis_keys.enqueued(lost.id)) is not None:
            break
    assert client.get(redis_keys.enqueued(lost.id)) == lost.queue
    assert client.llen(lost.queue) == 1  # only the lost one was sent
