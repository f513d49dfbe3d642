"""The joint gate: at most ``cap`` joint jobs run; it reports when it fills up and frees again."""

from __future__ import annotations

import itertools
import threading

from worker.class_gates import ClassGate


def test_gate_admits_up_to_cap_and_reports_fullness() -> None:
    calls: list[bool] = []
    gate = ClassGate(2, on_full=calls.append)
    assert gate.try_enter() and calls == []
    assert gate.try_enter() and calls == [True] and gate.full  # full: the joint consumer pauses
    assert not gate.try_enter()  # a message that slipped in is refused (handed back)
    assert gate.active == 2 and calls == [True]
    gate.leave()
    assert calls == [True, False] and gate.active == 1 and not gate.full
    gate.leave()
    assert calls == [True, False] and gate.active == 0  # not full: nothing to report
    assert gate.try_enter()


def test_a_failing_report_never_breaks_the_gate() -> None:
    def boom(full: bool) -> None:
        raise ConnectionError("broker down")

    gate = ClassGate(1, on_full=boom)
    assert gate.try_enter()
    assert not gate.try_enter()
    gate.leave()
    assert gate.try_enter()


def test_reports_arrive_in_the_order_the_gate_changed() -> None:
    """Fill and free race on many threads: the last report always matches the gate's state."""
    reports: list[bool] = []
    gate = ClassGate(1, on_full=reports.append)

    def churn() -> None:
        for _ in range(200):
            if gate.try_enter():
                gate.leave()

    threads = [threading.Thread(target=churn) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert gate.active == 0 and not gate.full
    assert reports and reports[-1] is False
    assert all(a != b for a, b in itertools.pairwise(reports))  # strictly alternating
