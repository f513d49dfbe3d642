"""Which beat process leads: a background thread that keeps (or tries to take) the leader lease.

Any number of ``cloverq beat`` processes may run (on one host or many); the one holding the
lease (``scheduler/infra/leader_lease.py``: a fenced Redis lease, why Redis is said there)
dispatches the periodic tasks, the others stand by (``scheduler/maintenance/beat_scheduler.py``
checks :meth:`BeatElection.is_leader` before every dispatch). Every process still consumes the
``maintenance`` and ``webhooks`` queues, so standbys share the work the leader dispatches.

One round every ``lease / 3`` seconds: the holder renews, anyone else tries to acquire. So a
leader that dies or hangs is replaced within ``lease + lease / 3`` (its last renew + the TTL, plus
at most one standby round); one that stops cleanly releases the lease (:meth:`BeatElection.stop`)
and a standby leads within one round. A renew that fails (Redis unreachable, the lease taken by
another after a hang) ends the leadership at the latest when the local validity runs out, without
waiting for Redis to answer.

Each round also publishes this process's state (``redis_keys.beat_member``: leader or standby,
fence, how many periodic tasks it dispatched and when last), expiring three rounds after it stops:
``/metrics`` reads it back (``cloverq_beat_leader``) and tests count dispatches per process.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

import redis
import structlog

from scheduler.infra.leader_lease import FencedLease
from scheduler.infra.redis_keys import BEAT_FENCE_KEY, BEAT_LEADER_KEY, BEAT_MEMBERS_SET, beat_member

log = structlog.get_logger(__name__)


def process_name() -> str:
    """This beat process's name in the lease and the metrics: ``<host>:<pid>``."""
    return f"{socket.gethostname()}:{os.getpid()}"


class BeatElection:
    """Keeps this process's claim on the beat leader lease current from a daemon thread."""

    def __init__(self, client: redis.Redis, *, lease_seconds: float, name: str | None = None,
                 report: Callable[[], Mapping[str, Any]] = dict) -> None:
        self.name = name or process_name()
        self.lease = FencedLease(client, key=BEAT_LEADER_KEY, fence_key=BEAT_FENCE_KEY,
                                 ttl_seconds=lease_seconds, name=self.name)
        self.round_seconds = lease_seconds / 3
        self._client = client
        self._report = report  # more fields for this process's published state (the scheduler's counts)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._led: int | None = None  # the fence of the leadership last logged (None: standby)
        self._failing = False

    def is_leader(self) -> bool:
        """Whether this process may dispatch periodic tasks now (local check, no round trip)."""
        return self.lease.holds()

    def leading_fence(self) -> int | None:
        """The fencing number this process leads under now, or None when it stands by (local check)."""
        return self.lease.valid_fence()

    def start(self) -> None:
        """One round now (a lone beat leads from its first tick), then one every ``round_seconds``."""
        self.run_round()
        self._thread = threading.Thread(target=self._loop, name="beat-election", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the rounds and hand the lease over (a standby takes it within one round)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.round_seconds + 5.0)
        try:
            if self.lease.release():
                log.info("beat.leader_released", fence=self._led, beat=self.name)
            self._client.delete(beat_member(self.name))
        except redis.RedisError:
            pass  # the lease expires on its own
        self._led = None

    def _loop(self) -> None:
        while not self._stop.wait(self.round_seconds):
            self.run_round()

    def run_round(self) -> None:
        """Renew or acquire, publish this process's state, log a change of leadership."""
        try:
            if not self.lease.renew():
                self.lease.acquire()
            self._publish()
            if self._failing:
                log.info("beat.election_recovered", beat=self.name)
            self._failing = False
        except redis.RedisError as exc:
            if not self._failing:  # once per outage; leadership runs out on its local clock
                log.warning("beat.election_failed", beat=self.name, error=f"{type(exc).__name__}: {exc}")
            self._failing = True
        self._log_change()

    def _publish(self) -> None:
        fence = self.lease.valid_fence()
        state = {**self._report(), "leader": fence is not None, "fence": fence}
        pipe = self._client.pipeline(transaction=False)
        pipe.set(beat_member(self.name), json.dumps(state), px=max(1, round(self.round_seconds * 3000)))
        pipe.sadd(BEAT_MEMBERS_SET, self.name)
        pipe.execute()

    def _log_change(self) -> None:
        fence = self.lease.valid_fence()
        if fence == self._led:
            return
        if self._led is not None:
            log.warning("beat.leader_lost", fence=self._led, beat=self.name)
        if fence is not None:
            log.info("beat.leader_acquired", fence=fence, beat=self.name)
        self._led = fence
