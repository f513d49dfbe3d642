"""A stopping API replica's drain: the window between SIGTERM and the listeners closing.

Why a window: behind a load balancer (HAProxy, a Kubernetes Service) new requests keep arriving
for a moment after a replica was told to stop, until the balancer's health check sees it go
unready. During ``api_drain_seconds`` the replica therefore keeps serving everything, while
``/readyz`` and ``/readyz/replica`` answer 503 (``api/routes/health.py``); only then do its
listeners close (``api/graceful_stop.py``). Waits that could outlast the window end at its
deadline with the answer they would give at their own deadline: a long poll
(``GET /v1/jobs/{id}?wait=``) answers with the job's status then, an event stream
(``GET /v1/jobs/{id}/events``) ends, and its client resumes elsewhere with ``Last-Event-ID``.
What cannot be resumed (OpenAI streams and blocking answers) keeps running into uvicorn's
graceful shutdown (``api_stop_grace_seconds``).

One process serves one app in production, but tests run several apps in one process: each app
owns an :class:`ApiDrain`, registered while its lifespan runs, and a stop request begins every
registered one (:func:`begin_process_drain`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)


class ApiDrain:
    """One app's drain state; ``deadline`` (``time.monotonic()``) is None until a stop begins it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_begin: Callable[[], None] | None = None

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def bind(self, loop: asyncio.AbstractEventLoop, on_begin: Callable[[], None]) -> None:
        """The app's event loop and what to run in it when the drain begins (wake the long polls,
        so each one re-reads its deadline)."""
        self._loop = loop
        self._on_begin = on_begin

    def begin(self) -> float:
        """Start the drain (idempotent; any thread); returns the seconds left in it."""
        if self.deadline is None:
            self.deadline = time.monotonic() + self.seconds
            log.info("api.draining", seconds=self.seconds)
            if self._loop is not None and self._on_begin is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._on_begin)
        return self.seconds_left()

    def seconds_left(self) -> float:
        """Seconds until the listeners close (0 once they may; 0 when no drain has begun)."""
        return 0.0 if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def cap(self, deadline: float) -> float:
        """``deadline`` (monotonic), or the drain's deadline when that comes first."""
        return deadline if self.deadline is None else min(deadline, self.deadline)


_ACTIVE: set[ApiDrain] = set()
_LOCK = threading.Lock()


def register(drain: ApiDrain) -> None:
    """``drain`` takes part in the process' stop from now on (the app's lifespan start-up)."""
    with _LOCK:
        _ACTIVE.add(drain)


def unregister(drain: ApiDrain) -> None:
    with _LOCK:
        _ACTIVE.discard(drain)


def begin_process_drain() -> float:
    """Begin the drain of every app this process serves; returns the longest time left in one
    (0 when none runs yet: nothing to wait for)."""
    with _LOCK:
        drains = list(_ACTIVE)
    return max((drain.begin() for drain in drains), default=0.0)
