"""A fenced leader lease in Redis: at most one holder at a time, each holding with a fencing number.

Why Redis and not a PostgreSQL advisory lock: the beat must elect a leader on every deployment,
and the embedded default database is SQLite, which has no advisory locks (nor sessions another
process could see die); Redis is there in every deployment (it is the broker), the beat already
depends on it to dispatch anything at all, and a lease with a TTL also covers a leader that
*hangs* (an advisory lock is held as long as the connection lives, even by a process that stopped
making progress). When Redis is down no leader can dispatch, but then neither could any beat.

The protocol (one Lua script each, so every step is atomic on the server):

- **acquire**: if the key is absent, ``INCR`` the fencing counter and ``SET key "<fence> <name>
  <token>" PX ttl`` (the equivalent of ``SET NX PX`` with the fence taken in the same step, so a
  fence is spent only on a real acquisition and counts them exactly);
- **renew**: ``PEXPIRE`` only if the key still holds exactly our value (compare-and-pexpire): a
  holder whose lease expired and was taken by another cannot renew it, even if it wakes up;
- **release**: ``DEL`` only if the key holds our value (a clean shutdown hands over at once).

The holder never trusts the key for its own checks: :meth:`FencedLease.holds` is a local clock
test, true until ``ttl x (1 - SAFETY)`` after the *start* of the last successful acquire or renew.
The server's expiry is counted from the command's arrival, which is later, so a holder stops
believing it leads before any other process can have acquired the lease (up to clock-rate drift,
which ``SAFETY`` covers). A process that hangs (GC pause, SIGSTOP, a stuck thread) and resumes
sees its own lease as expired before doing anything, without a round trip.

The fencing number increases with every acquisition for as long as Redis keeps its data (a Redis
that restarts empty starts again at 1). It tells leaderships apart in logs and metrics and makes
a stale holder's value differ from the current one even if a token repeated.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

SAFETY = 0.1  # fraction of the TTL a holder gives up early (clock-rate drift, the dispatch itself)

_ACQUIRE = """
if redis.call('exists', KEYS[1]) == 1 then return false end
local fence = redis.call('incr', KEYS[2])
local value = fence .. ' ' .. ARGV[1]
redis.call('set', KEYS[1], value, 'PX', ARGV[2])
return value
"""
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class Holding:
    """What this process holds: the key's value, its fencing number, and until when (local clock)."""

    value: str
    fence: int
    valid_until: float


@dataclass(frozen=True, slots=True)
class LeaseValue:
    """A lease key's value, parsed (for readers such as /metrics)."""

    fence: int
    name: str


def parse_value(raw: str | bytes | None) -> LeaseValue | None:
    """``"<fence> <name> <token>"`` -> (fence, name); None for a missing or foreign value."""
    if raw is None:
        return None
    text = raw.decode() if isinstance(raw, bytes) else raw
    parts = text.split(" ")
    if len(parts) != 3 or not parts[0].isdigit():
        return None
    return LeaseValue(fence=int(parts[0]), name=parts[1])


class FencedLease:
    """One process's side of a lease on ``key`` (fencing counter ``fence_key``) with ``ttl_seconds``.

    Single attempts only (no loop, no thread): the caller decides when to try again. Redis errors
    propagate; a failed renew leaves :meth:`holds` to run out on its own clock. The state is one
    attribute replaced whole, so another thread may call :meth:`holds` at any time.
    """

    def __init__(self, client: redis.Redis, *, key: str, fence_key: str, ttl_seconds: float, name: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if " " in name:
            raise ValueError(f"a lease holder's name has no spaces: {name!r}")
        self.key, self.fence_key, self.name = key, fence_key, name
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        self._token = secrets.token_hex(8)  # this process's instance: a restart under the same name differs
        self._held: Holding | None = None
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    @property
    def _ttl_ms(self) -> int:
        return max(1, round(self.ttl_seconds * 1000))

    def _valid_until(self, started: float) -> float:
        return started + self.ttl_seconds * (1.0 - SAFETY)

    @property
    def fence(self) -> int | None:
        """The fencing number of the lease this process last acquired and still believes it holds."""
        held = self._held
        return held.fence if held is not None else None

    def holds(self) -> bool:
        """Whether this process may act as the holder now (local clock; see the module docstring)."""
        return self.valid_fence() is not None

    def valid_fence(self) -> int | None:
        """The fencing number of the lease this process may act on now, or None: :meth:`holds` and
        :attr:`fence` read from one snapshot, so another thread's renew cannot slip between them."""
        held = self._held
        return held.fence if held is not None and self._clock() < held.valid_until else None

    def acquire(self) -> bool:
        """Take the lease if nobody holds it; True when this call took it."""
        started = self._clock()
        value = self._acquire(keys=[self.key, self.fence_key],
                              args=[f"{self.name} {self._token}", self._ttl_ms])
        if value is None:
            return False
        text = value.decode() if isinstance(value, bytes) else str(value)
        self._held = Holding(value=text, fence=int(text.split(" ", 1)[0]),
                             valid_until=self._valid_until(started))
        return True

    def renew(self) -> bool:
        """Extend the lease this process holds; False (and no longer held) when it is not ours any more."""
        held = self._held
        if held is None:
            return False
        started = self._clock()
        if int(self._renew(keys=[self.key], args=[held.value, self._ttl_ms])):
            self._held = Holding(value=held.value, fence=held.fence, valid_until=self._valid_until(started))
            return True
        self._held = None
        return False

    def release(self) -> bool:
        """Give the lease up now (clean shutdown: a standby need not wait for the TTL)."""
        held, self._held = self._held, None
        return held is not None and bool(int(self._release(keys=[self.key], args=[held.value])))
