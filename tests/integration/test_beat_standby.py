"""Two real ``cloverq beat`` processes: one leads, the other stands by and takes over in time.

Each beat has its own schedule file (its own data dir, as on separate hosts). Their published
states (``scheduler/maintenance/beat_leader.py``: leader or not, tasks dispatched, when last) show
that only the lease holder dispatches. The leader is first hung (SIGSTOP): the standby leads within
the bound (lease x 4/3), and the old leader, resumed, decides no dispatch more (it sees its lease
expired on its own clock before its next tick; ``last_dispatch`` is when a dispatch was decided, so
one decided just before the hang and sent on resuming is older than the hang, and its tick is
dropped by the consumer, as the last step shows). Then the new leader is killed (SIGKILL): the
resumed one leads again within the bound and dispatches. Last, one tick message delivered twice to
the beat left (what a stopping beat's hand-back of an unacked delivery can cause) runs once: the
second delivery is dropped; and a tick stamped with a superseded leadership's fence (what a leader
that hung between its decision and its send sends on resuming) is dropped by the real worker
(``scheduler/infra/periodic_tick.py``).
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis as redis_lib
from prometheus_client.parser import text_string_to_metric_families

from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.db import get_session_factory
from scheduler.infra.leader_lease import parse_value
from scheduler.infra.periodic_tick import BEAT_FENCE_HEADER
from scheduler.infra.queue_names import MAINTENANCE_QUEUE
from scheduler.infra.redis_keys import BEAT_LEADER_KEY, BEAT_MEMBERS_SET, beat_member
from scheduler.infra.settings import Settings
from scheduler.infra.tick_claims import TickClaim
from scheduler.observability.cluster_metrics import render_metrics
from tests.conftest import ProcessLauncher, ServiceProcess, wait_for

pytestmark = pytest.mark.integration

LEASE = 2.0
BOUND = LEASE * 4 / 3 + 1.5  # the documented bound plus slack for a loaded CI machine


def _state(client: redis_lib.Redis, name: str) -> dict[str, Any]:
    raw = client.get(beat_member(name))
    return json.loads(raw) if raw else {}


def _holder(client: redis_lib.Redis) -> str | None:
    lease = parse_value(client.get(BEAT_LEADER_KEY))
    return lease.name if lease is not None else None


def _fence(client: redis_lib.Redis) -> int:
    lease = parse_value(client.get(BEAT_LEADER_KEY))
    return lease.fence if lease is not None else 0


def _service(name: str, services: list[ServiceProcess]) -> ServiceProcess:
    """The launched process whose group holds the embedded beat process ``<host>:<pid>``."""
    group = os.getpgid(int(name.rsplit(":", 1)[1]))
    return next(service for service in services if service.pid == group)


def _leader_metrics(client: redis_lib.Redis) -> tuple[dict[str, float], float]:
    """``cloverq_beat_leader`` by beat and ``cloverq_beat_leader_changes_total``, as /metrics shows them."""
    body, _ = render_metrics(client)
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    leader = {s.labels["beat"]: s.value for s in families["cloverq_beat_leader"].samples}
    return leader, families["cloverq_beat_leader_changes"].samples[0].value


def _claimed(settings: Settings, message_id: str) -> bool:
    """Whether a tick message's claim is in SQL (``scheduler/infra/tick_claims.py``)."""
    with get_session_factory(settings.resolved_database_url)() as session:
        return session.get(TickClaim, message_id) is not None


def _takeover(client: redis_lib.Redis, *, by: str) -> float:
    """Seconds until ``by`` holds the lease (fails the test after the bound)."""
    started = time.monotonic()
    wait_for(lambda: _holder(client) == by, timeout=BOUND, interval=0.05, message=f"{by} to lead")
    return time.monotonic() - started


def test_standby_takes_over_from_a_hung_then_a_killed_leader(
    launcher: ProcessLauncher, make_settings: Callable[..., Settings], redis_client: redis_lib.Redis
) -> None:
    redis_client.delete(BEAT_LEADER_KEY, BEAT_MEMBERS_SET)  # no lease left by an earlier test's beat
    settings = make_settings(beat_lease_seconds=LEASE)
    services = [launcher.start_beat(settings) for _ in range(2)]

    def both_up() -> tuple[str, str] | None:
        names = sorted(redis_client.smembers(BEAT_MEMBERS_SET))
        states = {name: _state(redis_client, name) for name in names}
        leaders = [name for name, state in states.items() if state.get("leader")]
        if len(states) == 2 and len(leaders) == 1 and states[leaders[0]].get("dispatched"):
            return leaders[0], next(name for name in names if name != leaders[0])
        return None

    first, second = wait_for(both_up, timeout=60, interval=0.2, message="two beats, one leading")
    assert _holder(redis_client) == first
    assert _state(redis_client, second)["dispatched"] == 0  # the standby sends nothing
    leader_gauge, changes = _leader_metrics(redis_client)
    assert leader_gauge == {first: 1.0, second: 0.0} and changes == _fence(redis_client) >= 1
    first_service = _service(first, services)

    fence = _fence(redis_client)
    hung_at = time.time()
    os.killpg(first_service.pid, signal.SIGSTOP)  # the leader hangs (every thread of it)
    try:
        assert _takeover(redis_client, by=second) <= BOUND
        assert _fence(redis_client) > fence
    finally:
        os.killpg(first_service.pid, signal.SIGCONT)
    wait_for(lambda: _state(redis_client, first).get("leader") is False, timeout=BOUND, interval=0.05,
             message="the resumed leader to report it stands by")
    time.sleep(LEASE / 3)  # one more round of its ticks
    assert (_state(redis_client, first).get("last_dispatch") or 0) < hung_at  # nothing after resuming
    wait_for(lambda: _state(redis_client, second).get("dispatched"), timeout=LEASE, interval=0.05,
             message="the standby, now leading, to dispatch")

    _service(second, services).kill()  # the new leader dies
    took = _takeover(redis_client, by=first)
    assert took <= BOUND
    led_at = time.time()
    wait_for(lambda: (_state(redis_client, first).get("last_dispatch") or 0) > led_at, timeout=5,
             interval=0.1, message="the new leader to dispatch")

    # The same reconcile message twice, as a handed-back delivery arrives: one run, one drop.
    message_id = str(uuid.uuid4())
    app = create_celery_app(settings)
    for _ in range(2):
        app.send_task("cloverq.reconcile", task_id=message_id, queue=MAINTENANCE_QUEUE, expires=60)
    first_log = _service(first, services).log
    wait_for(lambda: f'"message_id": "{message_id}"' in first_log(), timeout=20, interval=0.1,
             message="the second delivery to be dropped")
    drops = [line for line in first_log().splitlines()
             if message_id in line and "tick.redelivery_dropped" in line]
    assert len(drops) == 1
    assert _claimed(settings, message_id)

    # A tick from the first leadership, sent after two takeovers: dropped, never claimed or run.
    stale_id = str(uuid.uuid4())
    app.send_task("cloverq.reconcile", task_id=stale_id, queue=MAINTENANCE_QUEUE, expires=60,
                  headers={BEAT_FENCE_HEADER: fence})
    wait_for(lambda: f'"message_id": "{stale_id}"' in first_log(), timeout=20, interval=0.1,
             message="the stale tick to be dropped")
    assert any(stale_id in line and "tick.stale_leader_dropped" in line for line in first_log().splitlines())
    assert not _claimed(settings, stale_id)
