"""SIGTERM drains an API process before its listeners close (``api/graceful_stop.py``,
``api/drain.py``); a second signal, or SIGINT, stops at once as uvicorn does."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

from api.drain import ApiDrain, begin_process_drain, register, unregister
from api.graceful_stop import GracefulStop


class Stops:
    """Records the ``stop_now`` calls (from the drain's thread or the handler)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, float]] = []
        self.called = threading.Event()

    def __call__(self, signum: int) -> None:
        self.calls.append((signum, time.monotonic()))
        self.called.set()


def test_first_sigterm_drains_then_stops() -> None:
    drain = ApiDrain(0.3)
    stops = Stops()
    asked = time.monotonic()
    GracefulStop(stops, begin=drain.begin)(signal.SIGTERM, None)
    assert stops.called.wait(5)
    assert drain.draining and drain.deadline is not None
    assert stops.calls == [(signal.SIGTERM, stops.calls[0][1])]
    assert stops.calls[0][1] - asked >= 0.25  # not before the drain ended


def test_second_sigterm_or_sigint_stops_at_once() -> None:
    drain = ApiDrain(30.0)
    stops = Stops()
    handler = GracefulStop(stops, begin=drain.begin)
    handler(signal.SIGTERM, None)
    handler(signal.SIGTERM, None)  # the operator insists: no 30 s drain
    assert [signum for signum, _ in stops.calls] == [signal.SIGTERM]
    time.sleep(0.1)
    assert len(stops.calls) == 1  # the drain's thread does not stop it a second time
    sigint = Stops()
    GracefulStop(sigint, begin=drain.begin)(signal.SIGINT, None)
    assert [signum for signum, _ in sigint.calls] == [signal.SIGINT]


def test_drain_caps_deadlines_and_wakes_the_app_in_its_loop() -> None:
    drain = ApiDrain(0.5)
    assert drain.cap(100.0) == 100.0 and not drain.draining

    async def run() -> float:
        woken = asyncio.Event()
        drain.bind(asyncio.get_running_loop(), woken.set)
        register(drain)
        try:
            left = await asyncio.to_thread(begin_process_drain)  # from another thread, as GracefulStop does
            await asyncio.wait_for(woken.wait(), 2)
            return left
        finally:
            unregister(drain)

    left = asyncio.run(run())
    assert 0.0 < left <= 0.5
    assert drain.deadline is not None and drain.cap(drain.deadline + 60) == drain.deadline
    assert drain.begin() <= left  # a second begin keeps the first deadline
