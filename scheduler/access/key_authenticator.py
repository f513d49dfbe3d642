"""Checking a presented API key: one lookup by id, a constant-time digest compare, a per-process cache.

Authenticated keys are cached per process for ``auth_cache_seconds`` (the submit path must
not pay a SQL round trip for every request); revocation is also pushed to a Redis set that
the rate-limit script reads on every request, so a revoked key is refused at once by every
API process while Redis is up, and at the latest after the cache TTL otherwise. A cached key's
expiry (a rotation's overlap, ``api_keys.rotate_key``) is checked on every use. **Last use**
(time and address) is recorded in memory per request and written by a background flush at most
once per ``last_used_flush_seconds`` per process, never by the request itself.
"""

from __future__ import annotations

import enum
import hmac
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import cast

import structlog
from sqlalchemy import Table, bindparam, or_, select, update
from sqlalchemy.orm import Session

from scheduler.access.api_keys import ApiKey, KeyInfo, key_info
from scheduler.access.key_format import hash_key, parse_key

log = structlog.get_logger(__name__)

LAST_USED_FLUSH_SECONDS = 60.0  # the most often one process writes a key's last use


class KeyRefusal(enum.Enum):
    """Why :meth:`KeyAuthenticator.check` refused a key."""

    INVALID = "invalid"  # malformed, unknown, forged or revoked (not told apart: that would leak)
    EXPIRED = "expired"  # the right secret, past its expires_at (rotated; the overlap ended)


@dataclass(frozen=True, slots=True)
class _CachedKey:
    key_hash: str
    info: KeyInfo
    expires_at: float | None  # the info's expires_at as a Unix time: compared on every use


def _cached_entry(row: ApiKey) -> _CachedKey:
    info = key_info(row)
    expires = info.expires_at.timestamp() if info.expires_at is not None else None
    return _CachedKey(key_hash=row.key_hash, info=info, expires_at=expires)


# Compared against when the id is unknown, so a miss costs the same digest compare as a hit.
_DUMMY_HASH = hash_key("000000000000", "x" * 43)


class NotCached(enum.Enum):
    """The type of :data:`NOT_CACHED`."""

    NOT_CACHED = "not cached"


NOT_CACHED = NotCached.NOT_CACHED


# Per process: SQL lookups per second (and burst) for key ids not known to exist; past that, ids
# are checked against a snapshot of every key id, refreshed at most every KNOWN_IDS_REFRESH_SECONDS.
UNKNOWN_LOOKUPS_PER_SECOND = 20.0
KNOWN_IDS_REFRESH_SECONDS = 1.0


class _LookupBudget:
    """A token bucket for the SQL lookups of ids this process has not seen (not thread-safe:
    the caller holds its lock)."""

    def __init__(self, rate: float, clock: Callable[[], float]) -> None:
        self._rate = rate
        self._tokens = rate
        self._clock = clock
        self._at = clock()

    def take(self) -> bool:
        now = self._clock()
        self._tokens = min(self._rate, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False


class KeyAuthenticator:
    """Authenticate bearer keys against the key table, with a short per-process cache.

    Unknown ids are cached like known ones, but a flood of *fresh* key-shaped ids would still cost
    one SQL lookup each (188/s in the fault run, issue 16). So lookups of ids not known to exist
    draw on a small per-process budget; once it is spent, such an id is checked against a snapshot
    of all key ids (one query, at most once per ``KNOWN_IDS_REFRESH_SECONDS``) and refused without
    a lookup when absent. Outside a flood nothing changes; during one, a key created in another
    process is accepted after at most one snapshot interval.

    A key's expiry is checked against ``wall_clock`` on every use, cached or not. Uses are noted
    in memory (:meth:`note_use`); a timer thread writes them (:meth:`flush_last_used`) at most once
    per ``last_used_flush_seconds``, so no request waits on, or pays for, that write.
    """

    def __init__(
        self,
        session_factory: Callable[[], Session],
        *,
        cache_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        unknown_lookups_per_second: float = UNKNOWN_LOOKUPS_PER_SECOND,
        last_used_flush_seconds: float = LAST_USED_FLUSH_SECONDS,
    ) -> None:
        self._session_factory = session_factory
        self._cache_seconds = cache_seconds
        self._clock = clock
        self._wall_clock = wall_clock
        self._cache: dict[str, _CachedKey | None] = {}
        self._cache_expiry: dict[str, float] = {}
        self._lock = threading.Lock()
        self._budget = _LookupBudget(unknown_lookups_per_second, clock)
        self._known_ids: frozenset[str] | None = None  # snapshot, taken only once the budget ran out
        self._known_at = 0.0
        self._snapshot_lock = threading.Lock()
        self._flush_seconds = last_used_flush_seconds
        self._used: dict[str, tuple[float, str | None]] = {}  # key id -> (Unix time, address), unwritten
        self._flush_timer: threading.Timer | None = None
        self._flushed_at: float | None = None  # monotonic time of the last flush
        self._flush_lock = threading.Lock()

    # --- authentication ---------------------------------------------------------------------------

    def check(self, key: str) -> KeyInfo | KeyRefusal:
        """The key's info if it is well formed, known, not revoked, not expired and its secret
        matches; else why not (blocking: may look the key up)."""
        parsed = parse_key(key)
        if parsed is None:
            return KeyRefusal.INVALID
        return _check(self._lookup(parsed[0]), *parsed, self._wall_clock())

    def check_cached(self, key: str) -> KeyInfo | KeyRefusal | NotCached:
        """Like :meth:`check` without any I/O: ``NOT_CACHED`` when that would need the database
        (the key's row is not in the cache, or its entry expired). Lets an async caller skip a
        thread-pool hop on the common path."""
        parsed = parse_key(key)
        if parsed is None:
            return KeyRefusal.INVALID
        cached = self._cached(parsed[0], self._clock())
        return cached if isinstance(cached, NotCached) else _check(cached, *parsed, self._wall_clock())

    def authenticate(self, key: str) -> KeyInfo | None:
        """:meth:`check`, with None for any refusal."""
        result = self.check(key)
        return result if isinstance(result, KeyInfo) else None

    def authenticate_cached(self, key: str) -> KeyInfo | NotCached | None:
        """:meth:`check_cached`, with None for any refusal."""
        result = self.check_cached(key)
        return None if isinstance(result, KeyRefusal) else result

    def forget(self, key_id: str) -> None:
        """Drop a cached key (after a revoke, rotation or network change in this process)."""
        with self._lock:
            self._cache.pop(key_id, None)
            self._cache_expiry.pop(key_id, None)

    def _cached(self, key_id: str, now: float) -> _CachedKey | NotCached | None:
        """The cache's entry for ``key_id`` (None: known not to exist), or ``NOT_CACHED``."""
        with self._lock:
            if key_id in self._cache and self._cache_expiry[key_id] > now:
                return self._cache[key_id]
        return NOT_CACHED

    def _lookup(self, key_id: str) -> _CachedKey | None:
        now = self._clock()
        cached = self._cached(key_id, now)
        if not isinstance(cached, NotCached):
            return cached
        if not self._worth_a_lookup(key_id):
            return None  # not cached: the snapshot is the cache, and a new key must not wait longer
        with self._session_factory() as session:
            row = session.get(ApiKey, key_id)
            entry = _cached_entry(row) if row is not None else None
        if self._cache_seconds > 0:
            with self._lock:
                if len(self._cache) > 10_000:  # unknown ids must not grow the cache without bound
                    self._cache.clear()
                    self._cache_expiry.clear()
                self._cache[key_id] = entry
                self._cache_expiry[key_id] = now + self._cache_seconds
        return entry

    def _worth_a_lookup(self, key_id: str) -> bool:
        """Whether ``key_id`` may exist: it is in the snapshot, the budget allows a lookup, or a
        (refreshed) snapshot holds it."""
        known = self._known_ids
        if known is not None and key_id in known:
            return True
        with self._lock:
            if self._budget.take():
                return True
        return key_id in self._known_id_snapshot()

    def _known_id_snapshot(self) -> frozenset[str]:
        """Every key id in the table, re-read at most once per interval (one thread reads)."""
        with self._snapshot_lock:
            now = self._clock()
            if self._known_ids is None or now - self._known_at >= KNOWN_IDS_REFRESH_SECONDS:
                with self._session_factory() as session:
                    self._known_ids = frozenset(session.scalars(select(ApiKey.key_id)))
                self._known_at = now
            return self._known_ids

    # --- last use ---------------------------------------------------------------------------------

    def note_use(self, key_id: str, address: str | None) -> None:
        """Remember that ``key_id`` was used now from ``address`` (no I/O: a dict write; at most
        once per flush interval it also starts the timer thread that writes the uses)."""
        with self._lock:
            self._used[key_id] = (self._wall_clock(), address)
            if self._flush_timer is not None:
                return
            since = None if self._flushed_at is None else self._clock() - self._flushed_at
            delay = 0.0 if since is None else max(0.0, self._flush_seconds - since)
            timer = threading.Timer(delay, self._timed_flush)
            timer.daemon = True
            timer.name = "cloverq-key-last-used"
            self._flush_timer = timer
        timer.start()

    def _timed_flush(self) -> None:
        try:
            self.flush_last_used()
        finally:
            with self._lock:
                self._flush_timer = None
                pending = bool(self._used)
            if pending:  # uses noted while this flush wrote: schedule the next one
                self._reschedule()

    def _reschedule(self) -> None:
        with self._lock:
            if self._flush_timer is not None or not self._used:
                return
            timer = threading.Timer(self._flush_seconds, self._timed_flush)
            timer.daemon = True
            timer.name = "cloverq-key-last-used"
            self._flush_timer = timer
        timer.start()

    def close(self) -> None:
        """Write the uses noted so far and cancel the pending timer (a process shutting down)."""
        with self._lock:
            timer, self._flush_timer = self._flush_timer, None
        if timer is not None:
            timer.cancel()
        self.flush_last_used()

    def flush_last_used(self) -> int:
        """Write the uses noted since the last flush (one transaction; a row's last use never moves
        back, whichever process writes last). Returns how many keys were written; a failure is
        logged and those uses are dropped (the next use records them again)."""
        with self._flush_lock:
            with self._lock:
                used, self._used = self._used, {}
                self._flushed_at = self._clock()
            if not used:
                return 0
            table = cast(Table, ApiKey.__table__)
            statement = (
                update(table)
                .where(table.c.key_id == bindparam("b_key_id"),
                       or_(table.c.last_used_at.is_(None), table.c.last_used_at < bindparam("b_at")))
                .values(last_used_at=bindparam("b_at"), last_used_address=bindparam("b_address"))
            )
            params = [{"b_key_id": key_id, "b_at": datetime.fromtimestamp(at, UTC), "b_address": address}
                      for key_id, (at, address) in sorted(used.items())]
            try:
                with self._session_factory() as session:
                    session.execute(statement, params)
                    session.commit()
            except Exception as exc:  # a lost last-use time must never fail anything
                log.warning("keys.last_used_flush_failed", keys=len(params), error=type(exc).__name__)
                return 0
            return len(params)


def _check(cached: _CachedKey | None, key_id: str, secret: str, now: float) -> KeyInfo | KeyRefusal:
    """The key's info if the row exists, is not revoked nor expired and the secret's digest matches
    (the digest is compared in constant time, against a dummy for unknown ids, so timing tells
    nothing about which ids exist). Expiry is told apart only for the right secret."""
    expected = cached.key_hash if cached is not None else _DUMMY_HASH
    matches = hmac.compare_digest(expected, hash_key(key_id, secret))
    if cached is None or not matches or cached.info.revoked:
        return KeyRefusal.INVALID
    if cached.expires_at is not None and cached.expires_at <= now:
        return KeyRefusal.EXPIRED
    return cached.info
