"""Canary routing as pure functions: the version a job is pinned to, its lane, a worker's target,
and the follower moving a promoted canary worker's consumers without a reload."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from scheduler.model_versions.canary_routing import (
    VersionRoute,
    basis_points,
    job_bucket,
    lane,
    lane_names,
    queue_of_lane,
    route_version,
    served_target,
)
from scheduler.model_versions.registry import Activation
from worker import model_switch_protocol
from worker.model_switch_protocol import ModelFollower

ROUTE = VersionRoute(stable="v1", canary="v2", basis_points=1000)  # 10 %


def test_route_is_deterministic_and_near_its_share() -> None:
    ids = [uuid.UUID(int=i * 7919 + 3) for i in range(20_000)]  # not random: the hash spreads them
    routed = [route_version(job_id, ROUTE) for job_id in ids]
    assert routed == [route_version(job_id, ROUTE) for job_id in ids]  # same answer every time
    share = routed.count("v2") / len(ids)
    assert 0.09 < share < 0.11, share
    assert set(routed) == {"v1", "v2"}
    assert route_version(ids[0], None) is None  # no canary: not pinned
    assert all(0 <= job_bucket(job_id) < 10_000 for job_id in ids[:100])


def test_lanes_and_percent() -> None:
    assert lane("interactive", "v2", ROUTE) == "canary.interactive"
    assert lane("interactive", "v1", ROUTE) == "interactive"
    assert lane("joint", None, ROUTE) == "joint"
    assert lane("bulk", "v2", None) == "bulk"  # canary over: plain queue again
    assert queue_of_lane("canary.joint") == "joint" and queue_of_lane("joint") == "joint"
    assert lane_names(["interactive", "bulk"], canary=True) == ["canary.interactive", "canary.bulk"]
    assert basis_points(10) == 1000 and basis_points(0.5) == 50 and ROUTE.percent == 10.0
    for bad in (0, 100, -1, 0.001):
        with pytest.raises(ValueError):
            basis_points(bad)


def test_served_target_by_track() -> None:
    assert served_target(stable="v1", canary="v2", track="canary") == ("v2", True)
    assert served_target(stable="v1", canary="v2", track="stable") == ("v1", False)
    assert served_target(stable="v2", canary=None, track="canary") == ("v2", False)


def _activation(version: str, canary: str | None, generation: int) -> Activation:
    return Activation(name="m", version=version, previous_version=None, generation=generation,
                      activated_at=datetime.now(UTC), activated_by="test", canary_version=canary,
                      canary_basis_points=1000 if canary else 0)


class FreeTurn:
    def take(self) -> bool:
        return True

    def release(self) -> None:
        pass


@contextlib.contextmanager
def _no_session() -> Iterator[None]:
    yield None


def test_canary_follower_switches_then_only_moves_lanes_on_promotion(monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"now": _activation("v1", None, 1)}
    monkeypatch.setattr(model_switch_protocol, "active_version", lambda _session, *, name: state["now"])
    served: dict[str, str] = {"version": "v1"}
    on_lane = {"now": False}
    switched: list[str] = []
    moves: list[bool] = []

    def switch(target: Activation) -> bool:
        switched.append(target.version)
        served["version"] = target.version
        on_lane["now"] = target.version == target.canary_version
        return True

    def move(on_lane_now: bool) -> None:
        moves.append(on_lane_now)
        on_lane["now"] = on_lane_now

    watcher = ModelFollower(model_name="m", sessions=_no_session, turn=FreeTurn(),  # type: ignore[arg-type]
                            interval=1.0, current=lambda: served["version"], switch=switch, track="canary",
                            current_lane=lambda: on_lane["now"], move_lane=move)
    assert watcher.check_once() is False and switched == []
    state["now"] = _activation("v1", "v2", 2)  # canary starts: load v2, canary lanes
    assert watcher.check_once() is True and switched == ["v2"] and on_lane["now"] is True
    state["now"] = _activation("v2", None, 3)  # promoted: same version, plain queues, no reload
    assert watcher.check_once() is False and switched == ["v2"] and moves == [False]
    state["now"] = _activation("v2", "v3", 4)
    assert watcher.check_once() is True and switched == ["v2", "v3"]
    state["now"] = _activation("v2", None, 5)  # aborted: back to the stable version
    assert watcher.check_once() is True and switched == ["v2", "v3", "v2"] and on_lane["now"] is False


def test_a_canary_worker_starting_during_a_canary_consumes_only_the_lanes() -> None:
    from scheduler.infra.celery_app import create_celery_app
    from scheduler.infra.settings import Settings
    from worker.consumers import ConsumerController

    queues = create_celery_app(Settings()).amqp.queues
    queues.select(["interactive", "standard", "bulk"])  # what `celery worker --queues` selected
    classes = ("interactive", "standard", "bulk")
    controller = ConsumerController(classes)
    controller.update(canary_lane=True)  # the served target at start (ModelSwitcher.load_initial)
    controller.select_at_start(queues)
    assert list(queues.consume_from) == ["canary.interactive", "canary.standard", "canary.bulk"]
    plain = create_celery_app(Settings()).amqp.queues
    plain.select(["interactive"])
    ConsumerController(("interactive",)).select_at_start(plain)
    assert list(plain.consume_from) == ["interactive"]


def test_canary_queues_are_those_a_live_canary_worker_consumes() -> None:
    """Rule 2 per queue: a canary pool without ``joint`` leaves canary joint jobs to stable."""
    from scheduler.fleet.workers import WorkerInfo
    from scheduler.model_versions.canary_reconcile import canary_queues

    def worker(version: str, queues: list[str], state: str = "ready", track: str = "canary") -> WorkerInfo:
        return WorkerInfo(id=version + ",".join(queues), hostname="h", pid=1, queues=queues, state=state,
                          model_version=f"{version}@abc", stats={"model_track": track})

    workers = [worker("v2", ["canary.interactive", "canary.bulk"]), worker("v1", ["joint"], track="stable"),
               worker("v2", ["joint"], state="failed")]
    assert canary_queues(workers, "m", "v2") == ["bulk", "interactive"]
    assert canary_queues(workers, "m", "v3") == []
