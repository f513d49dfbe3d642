"""Long polling: ``GET /v1/jobs/{id}?wait=S`` answers as soon as the job is final.

One pub/sub subscription per API process (``scheduler.jobs.finished_notice``: the worker publishes a
job's id after committing its outcome) wakes the requests waiting on that job; each then
re-reads the row. A waiting request holds no thread and no database connection, only an
``asyncio.Event``. Without notices (Redis down, a status written by the beat) a waiter still
re-reads every ``RECHECK_SECONDS``, so a notice is an optimisation, never a dependency.

The subscription's connection comes from the app's one asyncio Redis pool, the one the event
streams use (``api/job_follow.py`` ``stream_redis``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress

import redis.asyncio as aioredis
import structlog

from scheduler.infra.redis_keys import JOBS_FINISHED_CHANNEL

log = structlog.get_logger(__name__)

RECHECK_SECONDS = 1.0  # a waiter's first re-read without a notice; doubled after each one ...
MAX_RECHECK_SECONDS = 8.0  # ... up to this (a 30 s wait reads the row about 7 times at most)
RESUBSCRIBE_PAUSE_SECONDS = 1.0
HEALTH_CHECK_SECONDS = 30  # a half-open subscription socket is noticed and replaced (the pool's setting)


class JobWaiter:
    """Waiting requests by job id, woken by the jobs-finished channel."""

    def __init__(self, redis: Callable[[], aioredis.Redis]) -> None:
        """``redis``: the app's asyncio client (called in the running event loop, when subscribing)."""
        self._redis = redis
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._listener: asyncio.Task[None] | None = None
        self.notices = 0  # finished-notices that woke at least one waiter (tests, debugging)

    def start(self) -> None:
        """Subscribe in the background (API start-up; ``watch`` also starts it if needed)."""
        if self._listener is None or self._listener.done():
            self._listener = asyncio.get_running_loop().create_task(self._listen())

    @asynccontextmanager
    async def watch(self, job_id: str) -> AsyncIterator[asyncio.Event]:
        """An event set whenever ``job_id`` is announced final, registered for the block's
        duration (register BEFORE reading the row, so a notice in between is not missed)."""
        self.start()
        event = asyncio.Event()
        self._waiters.setdefault(job_id, set()).add(event)
        try:
            yield event
        finally:
            events = self._waiters.get(job_id)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiters[job_id]

    @property
    def waiting(self) -> int:
        """Requests waiting now (for tests and the curious)."""
        return sum(len(events) for events in self._waiters.values())

    def wake_all(self) -> None:
        """Wake every waiting request, as a notice for its job would (the API's drain began: each
        re-reads its job and its deadline, now capped by the drain's, ``api/drain.py``)."""
        for events in self._waiters.values():
            for event in events:
                event.set()

    async def close(self) -> None:
        """Stop the subscription (API shutdown)."""
        if self._listener is not None:
            self._listener.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await self._listener
            self._listener = None

    async def _listen(self) -> None:
        while True:
            try:
                async with self._redis().pubsub() as pubsub:  # its connection goes back to the pool
                    await pubsub.subscribe(JOBS_FINISHED_CHANNEL)
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self._wake(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis gone: waiters fall back to re-checking
                log.warning("job_waiter.subscription_lost", error=type(exc).__name__)
            await asyncio.sleep(RESUBSCRIBE_PAUSE_SECONDS)

    def _wake(self, data: bytes | str) -> None:
        job_id = data.decode() if isinstance(data, bytes) else data
        events = self._waiters.get(job_id)
        if events:
            self.notices += 1
            for event in events:
                event.set()
