"""A process's background releaser: a worker kicks it for every message it takes.

When a worker takes a message from a class's list, the list has room for one more, and the next
held job should take it now (by DRR), not at the next beat tick. The task thread that took the
message must not pay for that (a release pass reads SQL and publishes): it only *kicks*, and one
daemon thread per process runs the passes. Kicks for the same queue made while a pass runs
coalesce into the next pass, which fills all the room there is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)


class ReleaseKicker:
    """Runs ``release(queue)`` on its own thread for every queue kicked since its last pass."""

    def __init__(self, release: Callable[[str], int], *, name: str = "cloverq-fair-release") -> None:
        self._release = release
        self._name = name
        self._pending: set[str] = set()
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def kick(self, queue: str) -> None:
        """Ask for a release pass over ``queue`` (never blocks; starts the thread on first use)."""
        with self._wake:
            if self._closed:
                return
            self._pending.add(queue)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._wake.notify()

    def close(self, timeout: float = 2.0) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                queues = sorted(self._pending)
                self._pending.clear()
            for queue in queues:
                try:
                    self._release(queue)
                except Exception as exc:  # the next kick or the beat tick releases instead
                    log.warning("fair_share.kick_failed", queue=queue, error=f"{type(exc).__name__}: {exc}")
