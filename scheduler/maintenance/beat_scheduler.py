"""The beat's Celery scheduler: Celery's own, except that only the leader dispatches.

``cloverq beat`` runs Celery's embedded beat with this class (``--scheduler``, see
``scheduler/maintenance/beat.py`` ``beat_argv``). Why a scheduler subclass and not a check inside
each periodic task: a standby then sends nothing at all (no messages, no task runs that would
only return), the check sits in one place for every entry of the schedule, and a task run by
hand (``celery call``) stays unaffected. Celery's ``tick`` sends at most one due entry per call,
so the check before each tick is a check before each dispatch.

The lease is checked twice: before each tick (a standby does nothing else), and again in
:meth:`LeaderScheduler.apply_entry`, the last step before the send, which also stamps the message
with the fence it leads under (``periodic_tick.BEAT_FENCE_HEADER``). A leader that hangs after
that check still sends on resuming; the consumer drops such a tick, whose fence a newer
leadership superseded (``scheduler/infra/periodic_tick.py``). An entry withheld at that last
check counts as run on this beat (Celery reserved it in the same tick), and so does one whose
tick a consumer dropped as stale: a leader from another process sends every entry when it takes
over, and otherwise (this process leads again, under a new fence) the entry's next period
replaces the lost tick, as it replaces any tick lost (every tick is idempotent and periodic).

A standby's ticks return at once (it sleeps a quarter election round) and leave its schedule
untouched: when it takes over, every entry is due at once (each task is idempotent, docs/architecture.md
§3.3 "Beat with a standby") and runs on its interval from then on. A leader whose lease runs out
(it hung, or Redis stopped answering its renews) stops at its next tick, before Redis tells it.

Shutdown: Celery stops the embedded beat process with SIGTERM, whose default action ends it
without any cleanup; :func:`exit_on_sigterm` (connected to Celery's ``beat_embedded_init`` by
``scheduler/maintenance/beat.py``, so it runs in the embedded beat process only) turns the first
SIGTERM into ``SystemExit``, which Celery's beat loop handles by closing the scheduler, and
:meth:`LeaderScheduler.close` releases the lease so a standby leads within one round instead of
one lease.
"""

from __future__ import annotations

import signal
import time
from types import FrameType
from typing import Any

import structlog
from celery.beat import PersistentScheduler, ScheduleEntry

from scheduler.infra.periodic_tick import BEAT_FENCE_HEADER
from scheduler.infra.redis_client import get_redis
from scheduler.infra.settings import get_settings
from scheduler.maintenance.beat_leader import BeatElection

log = structlog.get_logger(__name__)

_exiting = False


def _exit_once(_signum: int, _frame: FrameType | None) -> None:
    global _exiting
    if not _exiting:  # a second SIGTERM (the worker's own stop) must not interrupt the close
        _exiting = True
        raise SystemExit(0)


def exit_on_sigterm(**_kwargs: Any) -> None:
    """``beat_embedded_init`` receiver: SIGTERM ends the beat loop through its cleanup (the lease is
    released) instead of killing the process on the spot."""
    signal.signal(signal.SIGTERM, _exit_once)


def stamped(entry: ScheduleEntry, fence: int) -> ScheduleEntry:
    """A copy of ``entry`` whose message carries ``fence`` (the schedule keeps the entry unstamped)."""
    headers = {**(entry.options.get("headers") or {}), BEAT_FENCE_HEADER: fence}
    return type(entry)(**dict(entry, options={**entry.options, "headers": headers}))


class LeaderScheduler(PersistentScheduler):
    """``PersistentScheduler`` whose ticks dispatch only while this process holds the lease.

    ``election``: given, or (``cloverq beat``) built from the process's settings
    (``beat.lease_seconds``, the Redis URL)."""

    def __init__(self, *args: Any, election: BeatElection | None = None, **kwargs: Any) -> None:
        self.dispatched = 0  # periodic tasks this process sent, and when last (its published state)
        self.last_dispatch: float | None = None  # wall clock: comparable across processes of a host
        self.election = election
        super().__init__(*args, **kwargs)
        if kwargs.get("lazy"):
            return  # introspection only (Celery builds lazy schedulers for that): no election
        if self.election is None:
            settings = get_settings()
            self.election = BeatElection(get_redis(settings.resolved_redis_url),
                                         lease_seconds=settings.beat.lease_seconds, report=self.report)
        self.election.start()

    def report(self) -> dict[str, Any]:
        """This process's dispatch counts, published with its election state (tests, operators)."""
        return {"dispatched": self.dispatched, "last_dispatch": self.last_dispatch}

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Celery's tick when this process leads; otherwise send nothing and sleep a quarter round."""
        if self.election is None or not self.election.is_leader():
            # a quarter round: a new leader's first dispatch follows its election closely
            round_seconds = self.election.round_seconds if self.election is not None else 1.0
            return float(min(round_seconds / 4, self.max_interval))
        return float(super().tick(*args, **kwargs))

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        """Celery's send of ``entry`` stamped with this leadership's fence, or nothing (not even
        Celery's "Sending due task" line) when the lease ran out since the tick began.
        ``last_dispatch`` is when the lease was checked, before the send."""
        decided_at = time.time()
        fence = self.election.leading_fence() if self.election is not None else None
        if fence is None:
            log.info("beat.dispatch_withheld", task=entry.task)
            return
        self.dispatched += 1
        self.last_dispatch = decided_at
        super().apply_entry(stamped(entry, fence), producer=producer)

    def close(self) -> None:
        """Release the lease first (a standby takes over within a round), then Celery's close."""
        if self.election is not None:
            self.election.stop()
        super().close()
