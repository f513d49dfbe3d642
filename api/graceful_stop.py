"""SIGTERM for ``cloverq api``: drain first (``api/drain.py``), then uvicorn's own shutdown.

uvicorn closes its listeners the moment SIGTERM arrives and cuts whatever still runs after
``timeout_graceful_shutdown``: a load balancer that has not yet noticed gets refused connections,
and a 30 s long poll is cut mid-wait (HAProxy then answers 502). Here the first SIGTERM begins
the drain (not ready, waits capped at its deadline) and the listeners close only when it ends.
A second SIGTERM, or SIGINT (Ctrl-C), stops at once as uvicorn does.

The drain is started from a thread of its own, never from the signal handler: the handler only
records the request, so nothing touches the event loop from signal context.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType

import uvicorn

from api.drain import begin_process_drain


class GracefulStop:
    """A signal handler: the first SIGTERM drains, then calls ``stop_now``; anything else (or a
    second SIGTERM) calls ``stop_now`` at once. ``stop_now(signum)`` is what uvicorn does on a
    signal (``should_exit``, and ``force_exit`` on a second SIGINT); ``begin`` starts the drain and
    returns its seconds left (default: every app of the process)."""

    def __init__(self, stop_now: Callable[[int], None],
                 begin: Callable[[], float] = begin_process_drain) -> None:
        self._stop_now = stop_now
        self._begin = begin
        self._draining = False
        self._cut_short = threading.Event()

    def __call__(self, signum: int, _frame: FrameType | None = None) -> None:
        if signum != signal.SIGTERM or self._draining:
            self._cut_short.set()
            self._stop_now(signum)
            return
        self._draining = True
        threading.Thread(target=self._drain_then_stop, args=(signum,), name="api-drain", daemon=True).start()

    def _drain_then_stop(self, signum: int) -> None:
        seconds = self._begin()
        if not self._cut_short.wait(seconds):
            self._stop_now(signum)


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose SIGTERM drains first (:class:`GracefulStop`)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._graceful = GracefulStop(lambda signum: uvicorn.Server.handle_exit(self, signum, None))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._graceful(sig, frame)
