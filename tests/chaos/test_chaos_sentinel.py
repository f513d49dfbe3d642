"""Redis behind Sentinel (``redis+sentinel://``): the master moves, every client follows.

Real processes on loopback: a master, a replica and three sentinels (``tests/chaos/sentinel_set.py``).

- A coordinated failover (``SENTINEL FAILOVER``) leaves the old master answering, as a master,
  for about ten seconds more: cloverq's clients (the process' sync client with a Lua script,
  the asyncio client of the event streams, the Celery publisher and consumer) must move to the
  new one within seconds all the same.
- A whole stack (API, beat, one worker) on ``redis+sentinel://`` loses its master to SIGKILL
  after writes the replica never received (the replica cut off first): what asynchronous
  replication loses. Jobs go in before, during and after; every accepted one ends exactly once.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import create_engine

from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.redis_client import async_redis_from_url, get_redis
from scheduler.infra.settings import Settings
from tests.chaos.conftest import (
    REPEATED_KILLS,
    TINY_PARAMS,
    ChaosStack,
    _wait_http,
    install_outcome_audit,
    start_api,
)
from tests.chaos.sentinel_set import SentinelSet, sentinel_missing
from tests.conftest import FAST_JOB_SETTINGS, ProcessLauncher, _create_postgres_database

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

FOLLOW_BOUND_SECONDS = 3.0  # FOLLOW_SECONDS (1 s) + one command's timeout margin on 2 busy cores
# ~16 denoising passes: jobs are running and queued when the master dies.
PARAMS: dict[str, Any] = {"max_new_tokens": 16, "steps_per_block": 4, "seed": 11}


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    missing = sentinel_missing()
    if missing:
        pytest.skip(missing)
    found = SentinelSet(tmp_path / "sentinel")
    try:
        found.start()
        yield found
    finally:
        found.stop()


def _until(predicate: Any, *, timeout: float) -> float:
    """Seconds until ``predicate()`` (called repeatedly) was true; fails after ``timeout``."""
    began = time.monotonic()
    while not predicate():
        assert time.monotonic() - began < timeout, f"not within {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - began


def test_clients_follow_a_coordinated_failover_within_seconds(sentinels: SentinelSet) -> None:
    url = sentinels.url
    sync = get_redis(url)
    script = sync.register_script("return redis.call('incr', KEYS[1])")
    assert script(keys=["probe:count"]) == 1  # loaded into the old master's script cache
    celery = create_celery_app(Settings(redis_url=url))
    probe_queue = f"probe-{uuid.uuid4().hex[:8]}"
    consumer = celery.connection_for_read()
    channel = consumer.default_channel  # a worker's channel: its BRPOP connection lives with it
    channel.client.connection = channel.client.connection_pool.get_connection()

    async def follow() -> None:
        stream = async_redis_from_url(url, decode_responses=True)
        await stream.xadd("probe:stream", {"n": "0"})
        old = sentinels.master()
        began = time.monotonic()  # figures: seconds from the SENTINEL FAILOVER command
        figures = {"sentinels named it": sentinels.failover()}
        new = sentinels.master()
        assert new is not old

        def sync_followed() -> bool:
            token = uuid.uuid4().hex
            sync.set("probe:sync", token)
            return bool(new.client().get("probe:sync") == token)

        _until(sync_followed, timeout=FOLLOW_BOUND_SECONDS)
        figures["sync client"] = time.monotonic() - began
        waited = time.monotonic()
        while True:  # the asyncio client (the event streams' XADD/XREAD)
            entry = await stream.xadd("probe:stream", {"n": "1"})
            if new.client().xrange("probe:stream", min=entry, max=entry):
                break
            assert time.monotonic() - waited < FOLLOW_BOUND_SECONDS, "the asyncio client stayed behind"
            await asyncio.sleep(0.02)
        figures["asyncio client"] = time.monotonic() - began
        read = await stream.xread({"probe:stream": "0"}, block=100)  # the new master's stream
        assert [fields["n"] for _, fields in read[0][1]] == ["0", "1"]

        def celery_followed() -> bool:
            celery.send_task("cloverq.sentinel_probe", queue=probe_queue)
            return bool(new.client().llen(probe_queue))

        _until(celery_followed, timeout=FOLLOW_BOUND_SECONDS)
        figures["celery publisher"] = time.monotonic() - began

        def consumer_noticed() -> bool:  # before its next BRPOP (one a second when idle)
            try:
                channel._brpop_start()
            except redis_lib.ConnectionError as exc:  # Celery then re-establishes the connection
                return "master moved" in str(exc)
            return False

        _until(consumer_noticed, timeout=FOLLOW_BOUND_SECONDS)
        figures["celery consumer"] = time.monotonic() - began
        consumer.release()
        # The Lua script runs on the new master (redis-py reloads it on NOSCRIPT if needed).
        cached = new.client().script_exists(script.sha)[0]
        assert script(keys=["probe:count"]) == 2
        # All of it while the old master still answered as a master: following, not demotion.
        assert old.client().info("replication")["role"] == "master"
        await stream.aclose()
        print(f"coordinated failover, seconds from SENTINEL FAILOVER: "
              f"{', '.join(f'{k} {v:.2f}' for k, v in figures.items())}; the Lua script was "
              f"{'' if cached else 'not '}in the new master's cache before its first call there")

    asyncio.run(follow())


def _database_url(root: Path) -> tuple[str, Any]:
    """A fresh database (PostgreSQL when the suite has one, else a SQLite file) and its drop."""
    base = os.environ.get("CLOVERQ_TEST_DATABASE_URL", "")
    if base.startswith("postgresql"):
        return _create_postgres_database(base)
    return f"sqlite:///{root / 'cloverq.db'}", lambda: None


@pytest.fixture
def sentinel_stack(
    sentinels: SentinelSet, demo_checkpoint: Path, tmp_path: Path
) -> Iterator[tuple[ChaosStack, str]]:
    """API (``cloverq api``), beat and one worker, all on ``redis+sentinel://``, auth on (so every
    submit runs the admission Lua script), with the outcome audit of the other chaos tests; and
    an API key."""
    from scheduler.access.dev_key import ensure_dev_key
    from scheduler.infra.db import make_engine, migrate, session_factory

    database_url, drop = _database_url(tmp_path)
    migrate(database_url)
    install_outcome_audit(database_url)
    settings = Settings(database_url=database_url, redis_url=sentinels.url, data_dir=tmp_path / "data",
                        model_dir=demo_checkpoint, **{**FAST_JOB_SETTINGS, "rate_limit_per_second": 0,
                                                      "tenant_max_active_jobs": 100_000,
                                                      "max_attempts": REPEATED_KILLS + 1})
    launcher = ProcessLauncher(tmp_path / "logs")
    launcher.log_dir.mkdir()
    api, api_url = start_api(launcher, settings)
    beat = launcher.start_beat(settings)
    worker = launcher.start_worker(settings, wait_ready=False)
    key_engine = make_engine(database_url)
    engine = create_engine(database_url, pool_pre_ping=True)
    try:
        key = ensure_dev_key(session_factory(key_engine), data_dir=settings.data_dir)
        stack = ChaosStack(settings=settings, redis=sentinels, postgres=None, launcher=launcher, api=api,
                           api_url=api_url, beat=beat, workers=[worker], engine=engine)
        launcher.wait_ready(worker, settings, timeout=120)
        _wait_http(api_url, api, timeout=120)
        sentinels.wait_quorum()  # they met while the stack started: now a dead master is failed over
        yield stack, key
    finally:
        launcher.close()
        key_engine.dispose()
        engine.dispose()
        drop()


def test_stack_on_sentinel_master_killed_after_unreplicated_writes_every_job_once(
    sentinel_stack: tuple[ChaosStack, str], sentinels: SentinelSet
) -> None:
    stack, key = sentinel_stack
    headers = {"Authorization": f"Bearer {key}"}
    outage: list[tuple[float, int, float]] = []  # (seconds after the kill, status, latency) of submits
    with stack.client(timeout=15.0, headers=headers) as client:
        accepted = [stack.submit(client, {**PARAMS, "seed": i}) for i in range(8)]
        stack.wait_some_running(accepted)
        sentinels.detach_replica()
        # These jobs' marker, message and admission reservations reach the master only.
        unreplicated = [stack.submit(client, {**TINY_PARAMS, "seed": 100 + i}) for i in range(4)]
        accepted += unreplicated
        stop = threading.Event()
        killed_at = time.monotonic()

        def submit_meanwhile() -> None:
            with stack.client(timeout=15.0, headers=headers) as own:
                while not stop.is_set():
                    sent = time.monotonic()
                    response = own.post("/v1/jobs", json={"kind": "generate", "input": {"prompt": "Sentinel"},
                                                          "params": TINY_PARAMS})
                    outage.append((sent - killed_at, response.status_code, time.monotonic() - sent))
                    if response.status_code == 202:
                        accepted.append(str(response.json()["id"]))
                    time.sleep(0.05)

        submitter = threading.Thread(target=submit_meanwhile)
        submitter.start()
        try:
            failover = sentinels.kill_master()
            time.sleep(1.5)  # submits go on through the new master
        finally:
            stop.set()
            submitter.join(timeout=30)
        accepted += [stack.submit(client, {**TINY_PARAMS, "seed": 200 + i}) for i in range(4)]
    statuses = [status for _, status, _ in outage]
    assert statuses and all(status in (202, 503) for status in statuses), outage  # accepted or told to retry
    waited = time.monotonic()
    rows = stack.wait_final(accepted, timeout=60)
    waited = time.monotonic() - waited
    stack.assert_exactly_once(accepted, rows)
    assert stack.beat.proc.poll() is None, "the beat process did not survive the failover"
    assert all(w.proc.poll() is None for w in stack.workers), "a worker did not survive the failover"
    without_master = [(status, latency) for t, status, latency in outage if t < failover]
    print(f"Sentinel failover (master SIGKILLed): sentinels named the new master after {failover:.2f} s; "
          f"submits meanwhile: {sum(1 for s, _ in without_master if s == 202)} x 202 (SQL only, published "
          f"by the reconciler), {sum(1 for s, _ in without_master if s == 503)} x 503, slowest "
          f"{max((lat for _, lat in without_master), default=0.0) * 1000:.0f} ms; {len(accepted)} accepted "
          f"({len(unreplicated)} with Redis writes the failover lost), all succeeded once, final "
          f"{waited:.2f} s after the last submit")
