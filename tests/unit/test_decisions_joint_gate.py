"""The joint gate: at most ``cap`` joint jobs run; the joint consumer pauses at the cap."""

from __future__ import annotations

from worker.joint_gate import JointGate


def test_gate_admits_up_to_cap_and_switches_the_consumer() -> None:
    calls: list[str] = []
    gate = JointGate(2, pause=lambda: calls.append("pause"), resume=lambda: calls.append("resume"))
    assert gate.try_enter() and calls == []
    assert gate.try_enter() and calls == ["pause"]  # full: stop taking joint messages
    assert not gate.try_enter()  # a message that slipped in is refused (handed back)
    assert gate.active == 2
    gate.leave()
    assert calls == ["pause", "resume"] and gate.active == 1
    gate.leave()
    assert calls == ["pause", "resume"] and gate.active == 0  # not paused: nothing to resume
    assert gate.try_enter()


def test_a_failing_switch_never_breaks_the_gate() -> None:
    def boom() -> None:
        raise ConnectionError("broker down")

    gate = JointGate(1, pause=boom, resume=boom)
    assert gate.try_enter()
    assert not gate.try_enter()
    gate.leave()
    assert gate.try_enter()
