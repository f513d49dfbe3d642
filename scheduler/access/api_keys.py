"""API keys: the key table, and create, list, revoke, rotate and restrict a key.

Only a digest of each key is ever stored (the format and the digest: ``key_format.py``); checking
a presented key on a request is ``key_authenticator.py``'s. A key belongs to one tenant and holds
scopes (``submit``, ``read``, ``webhooks``, ``admin``).

A key may be limited to networks (``allowed_networks``, CIDRs; none: any address); the API checks
the caller's address against them (``api/auth.py``). **Rotation** (:func:`rotate_key`) makes a
successor with the same tenant, scopes, label and networks (``rotated_from`` names the old key)
and gives the old key an ``expires_at`` at the end of the overlap; the authenticator's cached
entry carries the expiry and it is checked on every use, so a cached key stops working at that
instant in a process that has seen the rotation (other processes learn it within the cache TTL).
"""

from __future__ import annotations

import ipaddress
import re
import secrets
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import structlog
from sqlalchemy import Boolean, CursorResult, Index, String, Text, select, update
from sqlalchemy.orm import Mapped, Session, mapped_column

from scheduler.access.key_format import KEY_PREFIX, hash_key
from scheduler.access.networks import IPNetwork, normalised_networks, parse_networks
from scheduler.jobs.models import Base, UTCDateTime

log = structlog.get_logger(__name__)

SCOPE_SUBMIT = "submit"
SCOPE_READ = "read"
SCOPE_ADMIN = "admin"
SCOPE_WEBHOOKS = "webhooks"  # read and rotate the tenant's webhook signing secret
ALL_SCOPES: frozenset[str] = frozenset({SCOPE_SUBMIT, SCOPE_READ, SCOPE_WEBHOOKS, SCOPE_ADMIN})
DEFAULT_SCOPES: frozenset[str] = frozenset({SCOPE_SUBMIT, SCOPE_READ})

TENANT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")

MAX_ALLOWED_NETWORKS = 64
MAX_ROTATION_OVERLAP_SECONDS = 30 * 24 * 3600  # the longest overlap a rotation may give the old key


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


def key_info(row: ApiKey) -> KeyInfo:
    """What may be shown of ``row`` (its networks parsed once, here)."""
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
    return CreatedKey(key=key, info=key_info(row))


def list_keys(session: Session, *, tenant: str | None = None, include_revoked: bool = True) -> list[KeyInfo]:
    """Keys (no secrets), oldest first; ``tenant=None`` lists every tenant's."""
    query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.key_id)
    if tenant is not None:
        query = query.where(ApiKey.tenant == tenant)
    if not include_revoked:
        query = query.where(ApiKey.revoked.is_(False))
    return [key_info(row) for row in session.scalars(query)]


def revoke_key(session: Session, *, key_id: str) -> KeyInfo | None:
    """Mark a key revoked (kept for the audit trail); None if there is no such key."""
    session.execute(
        update(ApiKey)
        .where(ApiKey.key_id == key_id, ApiKey.revoked.is_(False))
        .values(revoked=True, revoked_at=_now())
    )
    session.commit()
    row = session.get(ApiKey, key_id)
    return key_info(row) if row is not None else None


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
    return key_info(row)


def rotate_key(session: Session, *, key_id: str, overlap_seconds: int) -> RotatedKey:
    """Make the successor of an active key and end the old one ``overlap_seconds`` from now.

    The successor has the old key's tenant, scopes, label and networks, and ``rotated_from`` =
    ``key_id``; it works at once. Both are written in one transaction, and the old key is claimed
    by a conditional UPDATE, so two concurrent rotations of one key make one successor. With no
    overlap the old key is also marked revoked: the caller then tells every API process at once
    (``scheduler.access.key_revocations.mark_revoked``), as for a revoke, and the Redis set stays what
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
    return RotatedKey(successor=CreatedKey(key=key, info=key_info(row)), previous=key_info(old),
                      overlap_seconds=overlap_seconds)


def _not_rotatable(row: ApiKey, now: datetime) -> str | None:
    if row.revoked:
        return "revoked"
    if row.expires_at is not None:
        return "expired" if row.expires_at <= now else "rotated already (its overlap is running)"
    return None
