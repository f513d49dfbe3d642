"""API keys: create, list, revoke, authenticate. Only a hash of each key is ever stored.

Key format: ``cq_<key_id>_<secret>``.

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
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import Boolean, Index, String, Text, select, update
from sqlalchemy.orm import Mapped, Session, mapped_column

from scheduler.jobs.models import Base, UTCDateTime
from scheduler.observability.audit import audit

SCOPE_SUBMIT = "submit"
SCOPE_READ = "read"
SCOPE_ADMIN = "admin"
SCOPE_WEBHOOKS = "webhooks"  # read and rotate the tenant's webhook signing secret
ALL_SCOPES: frozenset[str] = frozenset({SCOPE_SUBMIT, SCOPE_READ, SCOPE_WEBHOOKS, SCOPE_ADMIN})
DEFAULT_SCOPES: frozenset[str] = frozenset({SCOPE_SUBMIT, SCOPE_READ})

KEY_PREFIX = "cq"
KEY_PATTERN = re.compile(r"^cq_(?P<key_id>[0-9a-f]{12})_(?P<secret>[A-Za-z0-9_\-]{20,128})$")
# Anything that looks like one of our keys, wherever it appears in a string (log redaction).
KEY_SEARCH_PATTERN = re.compile(r"cq_[0-9a-f]{12}_[A-Za-z0-9_\-]{20,128}")
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")

DEV_KEY_FILE = "dev_api_key"  # under data_dir: the key `cloverq up` prints (embedded default only)


class ApiKey(Base):
    """One API key. ``key_hash`` is sha256 of ``<key_id>:<secret>``; the secret is never stored.

    Schema: Alembic revision ``0002_api_keys``.
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


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """What may be shown about a key: never the secret, never the hash."""

    key_id: str
    tenant: str
    scopes: frozenset[str]
    label: str | None
    created_at: datetime
    revoked: bool
    revoked_at: datetime | None


@dataclass(frozen=True, slots=True)
class CreatedKey:
    """A new key: ``key`` is the only copy of the secret; show it once."""

    key: str
    info: KeyInfo


class InvalidKeyRequest(ValueError):
    """A create request with an unknown scope or a malformed tenant name."""


def hash_key(key_id: str, secret: str) -> str:
    """The stored digest of a key (see the module docstring for why sha256 suffices)."""
    return hashlib.sha256(f"{key_id}:{secret}".encode()).hexdigest()


def parse_key(key: str) -> tuple[str, str] | None:
    """``(key_id, secret)`` of a well-formed key, else None."""
    match = KEY_PATTERN.match(key)
    if match is None:
        return None
    return match.group("key_id"), match.group("secret")


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
    )


def create_key(
    session: Session, *, tenant: str, scopes: Iterable[str] = DEFAULT_SCOPES, label: str | None = None
) -> CreatedKey:
    """Create and commit a key; the returned ``key`` string exists nowhere else."""
    if not TENANT_PATTERN.match(tenant):
        raise InvalidKeyRequest("tenant must be 1-64 chars of letters, digits, '_', '.', '-'")
    scope_set = parse_scopes(scopes)
    key_id = uuid.uuid4().hex[:12]
    secret = secrets.token_urlsafe(32)
    row = ApiKey(
        key_id=key_id,
        key_hash=hash_key(key_id, secret),
        tenant=tenant,
        scopes=" ".join(sorted(scope_set)),
        label=label,
        created_at=_now(),
        revoked=False,
    )
    session.add(row)
    session.commit()
    return CreatedKey(key=f"{KEY_PREFIX}_{key_id}_{secret}", info=_info(row))


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


@dataclass(frozen=True, slots=True)
class _CachedKey:
    key_hash: str
    info: KeyInfo


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
    """

    def __init__(
        self,
        session_factory: Callable[[], Session],
        *,
        cache_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        unknown_lookups_per_second: float = UNKNOWN_LOOKUPS_PER_SECOND,
    ) -> None:
        self._session_factory = session_factory
        self._cache_seconds = cache_seconds
        self._clock = clock
        self._cache: dict[str, _CachedKey | None] = {}
        self._cache_expiry: dict[str, float] = {}
        self._lock = threading.Lock()
        self._budget = _LookupBudget(unknown_lookups_per_second, clock)
        self._known_ids: frozenset[str] | None = None  # snapshot, taken only once the budget ran out
        self._known_at = 0.0
        self._snapshot_lock = threading.Lock()

    def authenticate(self, key: str) -> KeyInfo | None:
        """The key's info if it is well formed, known, not revoked and its secret matches."""
        parsed = parse_key(key)
        if parsed is None:
            return None
        return _check(self._lookup(parsed[0]), *parsed)

    def authenticate_cached(self, key: str) -> KeyInfo | NotCached | None:
        """Like :meth:`authenticate` without any I/O: ``NOT_CACHED`` when that would need the
        database (the key's row is not in the cache, or its entry expired). Lets an async
        caller skip a thread-pool hop on the common path."""
        parsed = parse_key(key)
        if parsed is None:
            return None
        cached = self._cached(parsed[0], self._clock())
        return cached if isinstance(cached, NotCached) else _check(cached, *parsed)

    def forget(self, key_id: str) -> None:
        """Drop a cached key (after a revoke in this process)."""
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
            entry = _CachedKey(key_hash=row.key_hash, info=_info(row)) if row is not None else None
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


def _check(cached: _CachedKey | None, key_id: str, secret: str) -> KeyInfo | None:
    """The key's info if the row exists, is not revoked and the secret's digest matches (the
    digest is compared in constant time, against a dummy for unknown ids, so timing tells
    nothing about which ids exist)."""
    expected = cached.key_hash if cached is not None else _DUMMY_HASH
    matches = hmac.compare_digest(expected, hash_key(key_id, secret))
    if cached is None or not matches or cached.info.revoked:
        return None
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
