"""API keys: create, list, revoke, rotate, authenticate. Only a hash of each key is ever stored.

Key format: ``cloverq_<key_id>_<secret>`` (keys made before the ``cloverq_`` prefix, ``cq_<key_id>_<secret>``,
keep working: both are parsed).

- ``cloverq_`` is distinctive on purpose: a secret scanner finds leaked keys with
  :data:`SCANNER_REGEX` (docs/security.md) without matching ordinary identifiers.
- ``key_id`` (12 hex chars) is not secret: it is the primary key, so authentication is one
  lookup by id (never a scan comparing hashes) and logs / audit lines can name a key safely.
- ``secret`` is 32 random bytes (``secrets.token_urlsafe``): 256 bits of entropy.

We store ``sha256("<key_id>:<secret>")``. A slow password hash (bcrypt, argon2) exists to
make guessing *low-entropy human passwords* expensive; a 256-bit random secret cannot be
guessed at any hash speed, so a fast hash loses nothing and keeps the per-request check
cheap. Binding the id into the hash means a stolen hash row cannot be replayed under another
id. The stored and computed digests are compared with ``hmac.compare_digest`` (constant time).

Authenticated keys are cached per process for ``auth_cache_seconds`` (the submit path must
not pay a SQL round trip for every request); revocation is also pushed to a Redis set that
the rate-limit script reads on every request, so a revoked key is refused at once by every
API process while Redis is up, and at the latest after the cache TTL otherwise.

A key may be limited to networks (``allowed_networks``, CIDRs; none: any address); the API checks
the caller's address against them (``api/auth.py``). **Rotation** (:func:`rotate_key`) makes a
successor with the same tenant, scopes, label and networks (``rotated_from`` names the old key)
and gives the old key an ``expires_at`` at the end of the overlap; the cached entry carries the
expiry and it is checked on every use, so a cached key stops working at that instant in a process
that has seen the rotation (other processes learn it within the cache TTL). **Last use** (time and
address) is recorded in memory per request and written by a background flush at most once per
``last_used_flush_seconds`` per process, never by the request itself.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import structlog
from sqlalchemy import Boolean, CursorResult, Index, String, Table, Text, bindparam, or_, select, update
from sqlalchemy.orm import Mapped, Session, mapped_column

from scheduler.access.networks import IPNetwork, normalised_networks, parse_networks
from scheduler.jobs.models import Base, UTCDateTime
from scheduler.observability.audit import audit

log = structlog.get_logger(__name__)

SCOPE_SUBMIT = "submit"
SCOPE_READ = "read"
SCOPE_ADMIN = "admin"
SCOPE_WEBHOOKS = "webhooks"  # read and rotate the tenant's webhook signing secret
ALL_SCOPES: frozenset[str] = frozenset({SCOPE_SUBMIT, SCOPE_READ, SCOPE_WEBHOOKS, SCOPE_ADMIN})
DEFAULT_SCOPES: frozenset[str] = frozenset({SCOPE_SUBMIT, SCOPE_READ})

KEY_PREFIX = "cloverq"  # new keys: cloverq_<key_id>_<secret>
LEGACY_KEY_PREFIX = "cq"  # keys made before the cloverq_ prefix; still accepted
KEY_PATTERN = re.compile(
    r"^(?:cloverq|cq)_(?P<key_id>[0-9a-f]{12})_(?P<secret>[A-Za-z0-9_\-]{20,128})$")
# Anything that looks like one of our keys (either prefix), wherever it appears in a string (log
# redaction keeps ``visible``, the prefix and the key id, and masks the rest).
KEY_SEARCH_PATTERN = re.compile(r"(?P<visible>(?:cloverq|cq)_[0-9a-f]{12})_[A-Za-z0-9_\-]{20,128}")
# For secret scanners (docs/security.md): a key made now, and nothing else, wherever it appears.
SCANNER_REGEX = r"(?<![A-Za-z0-9_])cloverq_[0-9a-f]{12}_[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])"
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_KEY_ID_PREFIX = re.compile(r"^(?:cloverq|cq)_(?P<key_id>[0-9a-f]{12})(?:_|$)")

MAX_ALLOWED_NETWORKS = 64
MAX_ROTATION_OVERLAP_SECONDS = 30 * 24 * 3600  # the longest overlap a rotation may give the old key
LAST_USED_FLUSH_SECONDS = 60.0  # the most often one process writes a key's last use

DEV_KEY_FILE = "dev_api_key"  # under data_dir: the key `cloverq up` prints (embedded default only)


class ApiKey(Base):
    """One API key. ``key_hash`` is sha256 of ``<key_id>:<secret>``; the secret is never stored.

    Schema: Alembic revisions ``0002_api_keys`` and ``0012_api_key_rotation`` (expiry, rotation,
    networks, last use).
    """

    __tablename__ = "api_keys"
    __table_args__ = (Index("ix_api_keys_tenant_created", "tenant", "created_at"),)

    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    tenant: Mapped[str] = mapped_column(String(128), nullable=False)
    scopes: Mapped[str] = mapped_column(Text, nullable=False)  # space-separated, sorted
    label: Mapped[str | None] = mapped_column(String(200), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)
    revoked: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # Refused from this instant on (set by a rotation: the end of its overlap). NULL: no expiry.
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # The key this one succeeded in a rotation.
    rotated_from: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # Space-separated canonical CIDRs the key may be used from; NULL: any address.
    allowed_networks: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Written by KeyAuthenticator's flush (at most once a minute per process), never per request.
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    last_used_address: Mapped[str | None] = mapped_column(String(64), nullable=True)


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """What may be shown about a key: never the secret, never the hash.

    ``allowed_networks`` is parsed once, when the row is read (the per-request check is a few
    comparisons); empty: any address."""

    key_id: str
    tenant: str
    scopes: frozenset[str]
    label: str | None
    created_at: datetime
    revoked: bool
    revoked_at: datetime | None
    expires_at: datetime | None = None
    rotated_from: str | None = None
    allowed_networks: tuple[IPNetwork, ...] = ()
    last_used_at: datetime | None = None
    last_used_address: str | None = None

    @property
    def networks(self) -> list[str]:
        """``allowed_networks`` as CIDR texts (what the CLI and the admin API show)."""
        return [str(network) for network in self.allowed_networks]

    def expired(self, now: datetime | None = None) -> bool:
        """Whether the key is past its ``expires_at`` (the end of a rotation's overlap)."""
        return self.expires_at is not None and self.expires_at <= (now or _now())

    def state(self, now: datetime | None = None) -> str:
        """``revoked``, ``expired``, ``rotating`` (rotated, the overlap still running) or ``active``."""
        if self.revoked:
            return "revoked"
        if self.expired(now):
            return "expired"
        return "rotating" if self.expires_at is not None else "active"


@dataclass(frozen=True, slots=True)
class CreatedKey:
    """A new key: ``key`` is the only copy of the secret; show it once."""

    key: str
    info: KeyInfo


@dataclass(frozen=True, slots=True)
class RotatedKey:
    """A rotation: the successor (its ``key`` shown once) and the old key, now with its expiry."""

    successor: CreatedKey
    previous: KeyInfo
    overlap_seconds: int


class InvalidKeyRequest(ValueError):
    """A create request with an unknown scope, a malformed tenant name or a bad network."""


class KeyNotFound(LookupError):
    """No key with that id."""


class KeyNotRotatable(ValueError):
    """The key is revoked, expired or already rotated (its overlap running): ``reason`` says which."""

    def __init__(self, key_id: str, reason: str) -> None:
        super().__init__(f"key {key_id} cannot be rotated: it is {reason}")
        self.key_id = key_id
        self.reason = reason


class KeyRefusal(enum.Enum):
    """Why :meth:`KeyAuthenticator.check` refused a key."""

    INVALID = "invalid"  # malformed, unknown, forged or revoked (not told apart: that would leak)
    EXPIRED = "expired"  # the right secret, past its expires_at (rotated; the overlap ended)


def hash_key(key_id: str, secret: str) -> str:
    """The stored digest of a key (see the module docstring for why sha256 suffices)."""
    return hashlib.sha256(f"{key_id}:{secret}".encode()).hexdigest()


def parse_key(key: str) -> tuple[str, str] | None:
    """``(key_id, secret)`` of a well-formed key (``cloverq_`` or legacy ``cq_``), else None."""
    match = KEY_PATTERN.match(key)
    if match is None:
        return None
    return match.group("key_id"), match.group("secret")


def key_id_of(text: str) -> str:
    """The key id in ``text``: a whole key, ``cloverq_<id>`` / ``cq_<id>``, or the id itself (as is)."""
    match = _KEY_ID_PREFIX.match(text.strip())
    return match.group("key_id") if match else text.strip()


def parse_scopes(text: str | Iterable[str]) -> frozenset[str]:
    """Scopes from ``"submit,read"`` (or an iterable); unknown ones are an error."""
    items = text.replace(" ", ",").split(",") if isinstance(text, str) else list(text)
    scopes = frozenset(item.strip() for item in items if item.strip())
    unknown = scopes - ALL_SCOPES
    if unknown:
        raise InvalidKeyRequest(f"unknown scope(s): {', '.join(sorted(unknown))}; "
                                f"known: {', '.join(sorted(ALL_SCOPES))}")
    if not scopes:
        raise InvalidKeyRequest("a key needs at least one scope")
    return scopes


def stored_networks(items: Iterable[str] | None) -> str | None:
    """The ``allowed_networks`` column for CIDR texts: canonical, space-separated, de-duplicated;
    None for none (any address). InvalidKeyRequest on a bad CIDR or too many."""
    try:
        networks = list(dict.fromkeys(normalised_networks(items or ())))
    except ValueError as exc:
        raise InvalidKeyRequest(f"invalid network: {exc}") from exc
    if len(networks) > MAX_ALLOWED_NETWORKS:
        raise InvalidKeyRequest(f"at most {MAX_ALLOWED_NETWORKS} networks per key")
    return " ".join(networks) or None


# A row whose networks do not parse (edited by hand) allows no address at all: fail closed.
_NO_NETWORK: tuple[IPNetwork, ...] = (ipaddress.ip_network("255.255.255.255/32"),)


def _row_networks(row: ApiKey) -> tuple[IPNetwork, ...]:
    if not row.allowed_networks:
        return ()
    try:
        return parse_networks(row.allowed_networks.split())
    except ValueError:
        log.error("keys.bad_allowed_networks", key_id=row.key_id, allowed_networks=row.allowed_networks)
        return _NO_NETWORK


def _now() -> datetime:
    return datetime.now(UTC)


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(
        key_id=row.key_id,
        tenant=row.tenant,
        scopes=frozenset(row.scopes.split()),
        label=row.label,
        created_at=row.created_at,
        revoked=row.revoked,
        revoked_at=row.revoked_at,
        expires_at=row.expires_at,
        rotated_from=row.rotated_from,
        allowed_networks=_row_networks(row),
        last_used_at=row.last_used_at,
        last_used_address=row.last_used_address,
    )


def _new_row(*, tenant: str, scopes: str, label: str | None, allowed_networks: str | None,
             rotated_from: str | None = None) -> tuple[ApiKey, str]:
    key_id = uuid.uuid4().hex[:12]
    secret = secrets.token_urlsafe(32)
    row = ApiKey(
        key_id=key_id,
        key_hash=hash_key(key_id, secret),
        tenant=tenant,
        scopes=scopes,
        label=label,
        created_at=_now(),
        revoked=False,
        allowed_networks=allowed_networks,
        rotated_from=rotated_from,
    )
    return row, f"{KEY_PREFIX}_{key_id}_{secret}"


def create_key(
    session: Session, *, tenant: str, scopes: Iterable[str] = DEFAULT_SCOPES, label: str | None = None,
    allowed_networks: Iterable[str] | None = None,
) -> CreatedKey:
    """Create and commit a key; the returned ``key`` string exists nowhere else.

    ``allowed_networks``: CIDRs the key may be used from (none: any address)."""
    if not TENANT_PATTERN.match(tenant):
        raise InvalidKeyRequest("tenant must be 1-64 chars of letters, digits, '_', '.', '-'")
    scope_set = parse_scopes(scopes)
    row, key = _new_row(tenant=tenant, scopes=" ".join(sorted(scope_set)), label=label,
                        allowed_networks=stored_networks(allowed_networks))
    session.add(row)
    session.commit()
    return CreatedKey(key=key, info=_info(row))


def list_keys(session: Session, *, tenant: str | None = None, include_revoked: bool = True) -> list[KeyInfo]:
    """Keys (no secrets), oldest first; ``tenant=None`` lists every tenant's."""
    query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.key_id)
    if tenant is not None:
        query = query.where(ApiKey.tenant == tenant)
    if not include_revoked:
        query = query.where(ApiKey.revoked.is_(False))
    return [_info(row) for row in session.scalars(query)]


def revoke_key(session: Session, *, key_id: str) -> KeyInfo | None:
    """Mark a key revoked (kept for the audit trail); None if there is no such key."""
    session.execute(
        update(ApiKey)
        .where(ApiKey.key_id == key_id, ApiKey.revoked.is_(False))
        .values(revoked=True, revoked_at=_now())
    )
    session.commit()
    row = session.get(ApiKey, key_id)
    return _info(row) if row is not None else None


def set_key_networks(session: Session, *, key_id: str, allowed_networks: Iterable[str] | None) -> KeyInfo:
    """Replace a key's ``allowed_networks`` (none: any address). KeyNotFound, InvalidKeyRequest.

    API processes apply it when their cached entry expires (``auth_cache_seconds``)."""
    stored = stored_networks(allowed_networks)
    row = session.get(ApiKey, key_id)
    if row is None:
        raise KeyNotFound(key_id)
    row.allowed_networks = stored
    session.commit()
    session.refresh(row)
    return _info(row)


def rotate_key(session: Session, *, key_id: str, overlap_seconds: int) -> RotatedKey:
    """Make the successor of an active key and end the old one ``overlap_seconds`` from now.

    The successor has the old key's tenant, scopes, label and networks, and ``rotated_from`` =
    ``key_id``; it works at once. Both are written in one transaction, and the old key is claimed
    by a conditional UPDATE, so two concurrent rotations of one key make one successor. With no
    overlap the old key is also marked revoked: the caller then tells every API process at once
    (``scheduler.access.admission.mark_revoked``), as for a revoke, and the Redis set stays what
    the revoked rows say (``scheduler.fleet.operator_state``).
    KeyNotFound; KeyNotRotatable (revoked, expired, or rotated already); InvalidKeyRequest (overlap
    out of 0..MAX_ROTATION_OVERLAP_SECONDS)."""
    if not 0 <= overlap_seconds <= MAX_ROTATION_OVERLAP_SECONDS:
        raise InvalidKeyRequest(f"overlap must be 0..{MAX_ROTATION_OVERLAP_SECONDS} seconds (30 days)")
    old = session.get(ApiKey, key_id)
    if old is None:
        raise KeyNotFound(key_id)
    now = _now()
    reason = _not_rotatable(old, now)
    if reason is not None:
        raise KeyNotRotatable(key_id, reason)
    expires_at = now + timedelta(seconds=overlap_seconds)
    ended = {"revoked": True, "revoked_at": now} if overlap_seconds == 0 else {}
    claimed = session.execute(
        update(ApiKey)
        .where(ApiKey.key_id == key_id, ApiKey.revoked.is_(False), ApiKey.expires_at.is_(None))
        .values(expires_at=expires_at, **ended)
        .execution_options(synchronize_session=False)
    )
    if cast("CursorResult[Any]", claimed).rowcount != 1:  # rotated or revoked meanwhile, elsewhere
        session.rollback()
        row = session.get(ApiKey, key_id, populate_existing=True)
        if row is None:
            raise KeyNotFound(key_id)
        raise KeyNotRotatable(key_id, _not_rotatable(row, _now()) or "rotated already")
    row, key = _new_row(tenant=old.tenant, scopes=old.scopes, label=old.label,
                        allowed_networks=old.allowed_networks, rotated_from=key_id)
    session.add(row)
    session.commit()
    session.refresh(old)
    return RotatedKey(successor=CreatedKey(key=key, info=_info(row)), previous=_info(old),
                      overlap_seconds=overlap_seconds)


def _not_rotatable(row: ApiKey, now: datetime) -> str | None:
    if row.revoked:
        return "revoked"
    if row.expires_at is not None:
        return "expired" if row.expires_at <= now else "rotated already (its overlap is running)"
    return None


@dataclass(frozen=True, slots=True)
class _CachedKey:
    key_hash: str
    info: KeyInfo
    expires_at: float | None  # the info's expires_at as a Unix time: compared on every use


def _cached_entry(row: ApiKey) -> _CachedKey:
    info = _info(row)
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


def ensure_dev_key(session_factory: Callable[[], Session], *, data_dir: Path) -> str:
    """The development key of the embedded default (what ``cloverq up`` prints).

    The secret cannot be recovered from the table, so the key is kept in
    ``data_dir/dev_api_key`` (mode 0600) and reused while it still authenticates; otherwise a
    fresh one (tenant ``default``, all scopes) is created and written there. This file is a
    convenience of the single-machine dev setup: production keys come from ``keys create``.
    """
    path = Path(data_dir) / DEV_KEY_FILE
    authenticator = KeyAuthenticator(session_factory, cache_seconds=0)
    if path.exists():
        existing = path.read_text().strip()
        if authenticator.authenticate(existing) is not None:
            return existing
    with session_factory() as session:
        created = create_key(session, tenant="default", scopes=ALL_SCOPES, label="dev key (cloverq up)")
    audit("key.create", actor_tenant=None, actor_key_id=None, via="up", target=created.info.key_id,
          tenant="default", scopes=sorted(ALL_SCOPES))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(created.key + "\n")
    path.chmod(0o600)
    return created.key
