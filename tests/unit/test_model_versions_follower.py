"""The worker's side of model versions without a broker: the job admission gate and the
follower's decisions (when to switch, turn taking, not retrying a version that failed)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from scheduler.model_versions.registry import Activation
from worker import model_switch_protocol
from worker.model_switch_protocol import JobsInFlight, ModelFollower


def test_admission_refuses_new_jobs_and_waits_for_admitted_ones() -> None:
    gate = JobsInFlight()
    assert gate.enter() and gate.enter()
    closed = threading.Event()

    def close() -> None:
        assert gate.close_and_wait(timeout=5)
        closed.set()

    closer = threading.Thread(target=close)
    closer.start()
    time.sleep(0.05)
    assert not gate.enter()  # closed: a newly delivered message is handed back
    gate.leave()
    assert not closed.wait(0.1)  # one admitted job still runs
    gate.leave()
    closer.join(timeout=5)
    assert closed.is_set() and gate.inside == 0
    gate.open()
    assert gate.enter()


def test_admission_close_times_out_while_a_job_runs() -> None:
    gate = JobsInFlight()
    assert gate.enter()
    assert gate.close_and_wait(timeout=0.05) is False


class FakeTurn:
    def __init__(self, free: bool = True) -> None:
        self.free = free
        self.taken = 0
        self.released = 0

    def take(self) -> bool:
        self.taken += self.free
        return self.free

    def release(self) -> None:
        self.released += 1


def activation(version: str, generation: int) -> Activation:
    return Activation(name="m", version=version, previous_version=None, generation=generation,
                      activated_at=datetime.now(UTC), activated_by="test")


@contextlib.contextmanager
def no_session() -> Iterator[None]:
    yield None


@pytest.fixture
def active(monkeypatch: pytest.MonkeyPatch) -> dict[str, Activation | None]:
    """What the fake SQL says is active (``active["now"]``)."""
    state: dict[str, Activation | None] = {"now": None}
    monkeypatch.setattr(model_switch_protocol, "active_version", lambda _session, *, name: state["now"])
    return state


def follower(served: dict[str, str], turn: FakeTurn, results: list[bool], calls: list[str]) -> ModelFollower:
    def switch(target: Activation) -> bool:
        calls.append(target.version)
        ok = results.pop(0)
        if ok:
            served["version"] = target.version
        return ok

    return ModelFollower(model_name="m", sessions=no_session, turn=turn, interval=1.0,  # type: ignore[arg-type]
                         current=lambda: served["version"], switch=switch)


def test_follower_switches_only_on_a_change_and_passes_the_turn(active: dict[str, Any]) -> None:
    served, turn, calls = {"version": "v1"}, FakeTurn(), []
    watcher = follower(served, turn, [True], calls)
    assert watcher.check_once() is False  # nothing active yet
    active["now"] = activation("v1", 1)
    assert watcher.check_once() is False and turn.taken == 0  # already serving it
    active["now"] = activation("v2", 2)
    assert watcher.check_once() is True
    assert calls == ["v2"] and served["version"] == "v2" and (turn.taken, turn.released) == (1, 1)
    assert watcher.check_once() is False


def test_follower_waits_while_another_worker_holds_the_turn(active: dict[str, Any]) -> None:
    served, turn, calls = {"version": "v1"}, FakeTurn(free=False), []
    watcher = follower(served, turn, [True], calls)
    active["now"] = activation("v2", 2)
    assert watcher.check_once() is False and calls == []
    turn.free = True
    assert watcher.check_once() is True and calls == ["v2"]


def test_follower_does_not_retry_a_failed_version_until_the_next_activation(active: dict[str, Any]) -> None:
    served, turn, calls = {"version": "v1"}, FakeTurn(), []
    watcher = follower(served, turn, [False, True], calls)
    active["now"] = activation("broken", 2)
    assert watcher.check_once() is False and turn.released == 1
    assert watcher.check_once() is False and calls == ["broken"]  # not retried every poll
    active["now"] = activation("broken", 3)  # the operator activates it again (e.g. after a fix)
    assert watcher.check_once() is True and calls == ["broken", "broken"]
