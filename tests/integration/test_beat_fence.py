"""The beat stamps each periodic tick with the fence it leads under, checks its lease again at
the send, and the consumer drops a tick whose leadership a newer one superseded
(``scheduler/maintenance/beat_scheduler.py``, ``scheduler/infra/periodic_tick.py``): a leader that
hung between its check and its send cannot run a tick after a standby took over. Real Redis (the
broker the messages land in, the fencing counter); the election is a stand-in whose answers the
test sets, since the race it stands for (a hang between two lines) cannot be timed from outside."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib

from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.periodic_tick import BEAT_FENCE_HEADER
from scheduler.infra.settings import Settings
from scheduler.maintenance.beat_scheduler import LeaderScheduler

pytestmark = pytest.mark.integration


class Election:
    """The answers of ``BeatElection`` the scheduler reads, set by the test."""

    round_seconds = 1.0

    def __init__(self, *, leads_at_tick: bool, fence_at_send: int | None) -> None:
        self.leads_at_tick, self.fence_at_send = leads_at_tick, fence_at_send

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def is_leader(self) -> bool:
        return self.leads_at_tick

    def leading_fence(self) -> int | None:
        return self.fence_at_send


@pytest.fixture
def broker(make_settings: Any) -> Iterator[tuple[Settings, redis_lib.Redis]]:
    settings = make_settings()
    client = redis_lib.Redis.from_url(settings.resolved_redis_url, decode_responses=True)
    client.flushdb()
    yield settings, client
    client.flushdb()


def _sent(client: redis_lib.Redis) -> list[dict[str, Any]]:
    """Every message waiting in the broker's queue lists, decoded."""
    return [json.loads(raw) for key in client.scan_iter() if client.type(key) == "list"
            for raw in client.lrange(key, 0, -1)]


def _scheduler(settings: Settings, tmp_path: Path, election: Election) -> LeaderScheduler:
    """The beat's scheduler on the real schedule, every entry due (as when a new leader takes over)."""
    app = create_celery_app(settings)
    scheduler = LeaderScheduler(app=app, schedule_filename=str(tmp_path / "schedule"), election=election)
    for entry in scheduler.schedule.values():
        entry.last_run_at = app.now() - timedelta(days=1)
    return scheduler


@pytest.mark.parametrize("fence", [1, 7])
def test_a_leader_stamps_every_tick_with_its_fence(
    broker: tuple[Settings, redis_lib.Redis], tmp_path: Path, fence: int
) -> None:
    settings, client = broker
    scheduler = _scheduler(settings, tmp_path, Election(leads_at_tick=True, fence_at_send=fence))
    try:
        for _ in range(3):
            scheduler.tick()
        kept = [entry.options for entry in scheduler.schedule.values()]
    finally:
        scheduler.close()
    messages = _sent(client)
    assert len(messages) == scheduler.dispatched == 3
    assert all(m["headers"][BEAT_FENCE_HEADER] == fence for m in messages)
    assert all(BEAT_FENCE_HEADER not in (options.get("headers") or {}) for options in kept)  # unstamped


def test_a_lease_that_runs_out_between_the_tick_and_the_send_sends_nothing(
    broker: tuple[Settings, redis_lib.Redis], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing sent, nothing counted, and no "Sending due task" line (what bench.fleet counts)."""
    settings, client = broker
    scheduler = _scheduler(settings, tmp_path, Election(leads_at_tick=True, fence_at_send=None))
    try:
        with caplog.at_level(logging.INFO, logger="celery.beat"):
            for _ in range(3):
                scheduler.tick()
    finally:
        scheduler.close()
    assert _sent(client) == []
    assert scheduler.dispatched == 0 and scheduler.last_dispatch is None
    assert "Sending due task" not in caplog.text


def test_a_leaders_send_is_logged_as_celery_logs_it(
    broker: tuple[Settings, redis_lib.Redis], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings, _client = broker
    scheduler = _scheduler(settings, tmp_path, Election(leads_at_tick=True, fence_at_send=2))
    try:
        with caplog.at_level(logging.INFO, logger="celery.beat"):
            scheduler.tick()
    finally:
        scheduler.close()
    assert caplog.text.count("Sending due task") == 1


def test_a_standby_sends_nothing(broker: tuple[Settings, redis_lib.Redis], tmp_path: Path) -> None:
    settings, client = broker
    scheduler = _scheduler(settings, tmp_path, Election(leads_at_tick=False, fence_at_send=3))
    try:
        assert scheduler.tick() == pytest.approx(Election.round_seconds / 4)
    finally:
        scheduler.close()
    assert _sent(client) == [] and scheduler.dispatched == 0
