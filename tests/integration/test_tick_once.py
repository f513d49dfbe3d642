"""A periodic tick's message runs once: a second delivery of the same message id is dropped, on
real Redis and a real database of each backend; the claim is a row in SQL, so it outlives a Redis
that lost its data (what a Sentinel failover does to the old master's writes); a tick whose claim
cannot reach the database is dropped rather than run unclaimed; a tick from a superseded beat
leadership is dropped (``scheduler/infra/periodic_tick.py``, ``scheduler/infra/tick_claims.py``)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis as redis_lib
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from celery import states
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from scheduler.infra import periodic_tick, redis_keys, tick_claims
from scheduler.infra.db import get_session_factory, make_engine, session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Base
from scheduler.maintenance import tasks

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(make_settings: Any, fresh_db_url: str) -> Settings:
    return make_settings(database_url=fresh_db_url, fair_share=False)


@pytest.fixture
def client(settings: Settings) -> Iterator[redis_lib.Redis]:
    c = redis_lib.Redis.from_url(settings.resolved_redis_url, decode_responses=True)
    c.flushdb()
    yield c
    c.flushdb()


@pytest.fixture
def sessions(settings: Settings) -> sessionmaker[Session]:
    return get_session_factory(settings.resolved_database_url)


@pytest.fixture
def runs(settings: Settings, client: redis_lib.Redis, sessions: sessionmaker[Session],
         monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The reconcile tick on this test's database and Redis; each run of its body is recorded."""
    seen: list[str] = []

    def resources() -> tuple[Any, redis_lib.Redis, Settings]:
        seen.append("run")
        return sessions(), client, settings

    monkeypatch.setattr(tasks, "_resources", resources)
    monkeypatch.setattr(periodic_tick, "tick_redis", lambda: client)
    monkeypatch.setattr(periodic_tick, "tick_session", sessions)
    return seen


def _claims(sessions: sessionmaker[Session]) -> dict[str, tick_claims.TickClaim]:
    with sessions() as session:
        return {row.message_id: row for row in session.scalars(select(tick_claims.TickClaim))}


def _tick(message_id: str | None = None, fence: int | None = None) -> str:
    headers = {periodic_tick.BEAT_FENCE_HEADER: fence} if fence is not None else None
    result = tasks.reconcile_task.apply(task_id=message_id or str(uuid.uuid4()), headers=headers)
    return str(result.state)


def test_the_same_tick_message_delivered_twice_runs_once(
    sessions: sessionmaker[Session], runs: list[str]
) -> None:
    message_id = str(uuid.uuid4())
    began = datetime.now(UTC)
    assert _tick(message_id) == states.SUCCESS
    assert _tick(message_id) == states.IGNORED
    assert runs == ["run"]
    row = _claims(sessions)[message_id]
    assert row.task == "cloverq.reconcile"
    lifetime = (row.expires_at - began).total_seconds()  # no expires: the default lifetime
    assert periodic_tick.CLAIM_DEFAULT_SECONDS - 5 < lifetime <= periodic_tick.CLAIM_DEFAULT_SECONDS + 5
    assert _tick() == states.SUCCESS  # another tick runs
    assert runs == ["run", "run"]


def test_the_claim_outlives_a_redis_that_lost_its_data(client: redis_lib.Redis, runs: list[str]) -> None:
    """A Sentinel failover hands out a tick again from the promoted replica and loses what was
    written to the old master since: the second delivery still finds its claim (in SQL)."""
    message_id = str(uuid.uuid4())
    assert _tick(message_id) == states.SUCCESS
    client.flushdb()
    assert _tick(message_id) == states.IGNORED
    assert runs == ["run"]


def test_a_tick_called_as_a_function_runs_without_a_claim(
    sessions: sessionmaker[Session], runs: list[str]
) -> None:
    tasks.reconcile_task()
    tasks.reconcile_task()
    assert runs == ["run", "run"]
    assert _claims(sessions) == {}


def test_a_tick_whose_claim_cannot_reach_the_database_is_dropped(
    runs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine("postgresql+psycopg://postgres@127.0.0.1:1/none")  # nothing listens
    try:
        monkeypatch.setattr(periodic_tick, "tick_session", session_factory(engine))
        assert _tick() == states.IGNORED
    finally:
        engine.dispose()
    assert runs == []


def test_two_deliveries_claiming_at_once_run_once(sessions: sessionmaker[Session]) -> None:
    """The primary key decides, not a read before the write: of 8 threads claiming one id at the
    same moment, exactly one wins."""
    barrier = threading.Barrier(8)
    expires_at = datetime.now(UTC) + timedelta(minutes=5)

    def claim(_: int) -> bool:
        with sessions() as session:
            barrier.wait()
            return tick_claims.claim(session, task="t", message_id="m", expires_at=expires_at)

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(claim, range(8)))
    assert sorted(won) == [False] * 7 + [True]


def test_a_fenced_tick_whose_fence_cannot_be_read_is_dropped(
    runs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    unreachable = redis_lib.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))  # nothing listens
    monkeypatch.setattr(periodic_tick, "tick_redis", lambda: unreachable)
    assert _tick(fence=3) == states.IGNORED
    assert _tick() == states.SUCCESS  # no fence: Redis is not asked
    assert runs == ["run"]


def test_a_tick_from_a_superseded_leadership_is_dropped(client: redis_lib.Redis, runs: list[str]) -> None:
    """A leader that hung between deciding a dispatch and sending it sends on resuming, after a
    newer leader took over (the fencing counter moved on): that tick is dropped, not run twice."""
    assert _tick(fence=5) == states.SUCCESS  # no counter (a Redis restarted empty): none supersedes it
    client.set(redis_keys.BEAT_FENCE_KEY, 5)
    assert _tick(fence=5) == states.SUCCESS  # the current leadership's tick
    client.set(redis_keys.BEAT_FENCE_KEY, 6)  # a standby took over
    assert _tick(fence=5) == states.IGNORED
    assert _tick(fence=6) == states.SUCCESS
    assert _tick() == states.SUCCESS  # sent by hand (no header): not checked
    assert runs == ["run"] * 4
    client.set(redis_keys.BEAT_FENCE_KEY, 2)  # restarted empty since: a higher fence still runs
    assert _tick(fence=6) == states.SUCCESS


def test_the_purge_tick_deletes_the_claims_past_their_lifetime(
    sessions: sessionmaker[Session], runs: list[str]
) -> None:
    now = datetime.now(UTC)
    with sessions() as session:
        for name, at in (("old", now - timedelta(seconds=1)), ("live", now + timedelta(minutes=5))):
            assert tick_claims.claim(session, task="t", message_id=name, expires_at=at)
        assert not tick_claims.claim(session, task="t", message_id="live", expires_at=at)
    tasks.purge_data_task()  # the beat's purge tick, called as a function (no claim of its own)
    assert runs == ["run"]
    assert set(_claims(sessions)) == {"live"}


def test_every_periodic_task_claims_its_message() -> None:
    from scheduler.infra.beat_schedule import beat_schedule
    from scheduler.infra.celery_app import create_celery_app
    from scheduler.infra.settings import Settings as S

    app = create_celery_app(S())
    app.loader.import_default_modules()
    names = {entry["task"] for entry in beat_schedule(S()).values()}
    assert names and all(isinstance(app.tasks[name], periodic_tick.OncePerMessage) for name in names)


def test_a_claim_lasts_until_a_minute_after_its_message_expires() -> None:
    now = datetime(2026, 12, 5, 12, 0, 0, tzinfo=UTC)
    in_ten = (now + timedelta(seconds=10)).isoformat()
    assert periodic_tick.claim_seconds(in_ten, now=now) == 10 + periodic_tick.CLAIM_MARGIN_SECONDS
    assert periodic_tick.claim_seconds(now - timedelta(hours=1), now=now) == 1  # expired: a short claim
    assert periodic_tick.claim_seconds(None, now=now) == periodic_tick.CLAIM_DEFAULT_SECONDS


def test_the_claims_table_matches_its_migration(fresh_db_url: str) -> None:
    engine = make_engine(fresh_db_url)
    try:
        with engine.connect() as conn:
            diffs = [d for d in compare_metadata(MigrationContext.configure(conn), Base.metadata)
                     if "tick_claims" in repr(d)]
    finally:
        engine.dispose()
    assert diffs == []
