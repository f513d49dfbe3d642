"""Signing webhook deliveries: the per-tenant secret, the signature header, and its check.

Signature: ``X-Cloverq-Signature: t=<unix ts>,v1=<hex HMAC-SHA256(secret, "<ts>." + body)>``,
with a per-tenant secret (``webhook_secrets``; ``GET /v1/webhooks/secret`` shows it to the
tenant). Receivers recompute the HMAC over the raw body and reject old timestamps (replays):
:func:`verify_signature` is what a receiver does.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from scheduler.jobs.models import utcnow
from scheduler.webhooks.tables import WebhookSecret

SIGNATURE_HEADER = "X-Cloverq-Signature"
DEFAULT_TOLERANCE_SECONDS = 300


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """Hex HMAC-SHA256 of ``"<timestamp>." + body`` under ``secret``."""
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def signature_header(secret: str, timestamp: int, body: bytes) -> str:
    """The ``X-Cloverq-Signature`` value: ``t=<ts>,v1=<hex>``."""
    return f"t={timestamp},v1={sign(secret, timestamp, body)}"


def verify_signature(
    secret: str, header: str, body: bytes, *, tolerance_seconds: float = DEFAULT_TOLERANCE_SECONDS,
    now: float | None = None,
) -> bool:
    """What a receiver does: check the HMAC (constant time) and that the timestamp is fresh."""
    try:
        parts = dict(item.split("=", 1) for item in header.split(","))
        timestamp = int(parts["t"])
        given = parts["v1"]
    except (KeyError, ValueError):
        return False
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance_seconds:
        return False
    return hmac.compare_digest(given, sign(secret, timestamp, body))


def tenant_secret(session: Session, *, tenant: str) -> str:
    """The tenant's signing secret, created (and committed) on first use."""
    row = session.get(WebhookSecret, tenant)
    if row is not None:
        return row.secret
    try:
        with session.begin_nested():
            session.add(WebhookSecret(tenant=tenant, secret=secrets.token_hex(32), created_at=utcnow()))
    except IntegrityError:  # created concurrently: use the winner's
        pass
    session.commit()
    row = session.get(WebhookSecret, tenant, populate_existing=True)
    assert row is not None
    return row.secret


def rotate_secret(session: Session, *, tenant: str) -> str:
    """Replace the tenant's secret (deliveries signed from now on use the new one)."""
    row = session.get(WebhookSecret, tenant)
    fresh = secrets.token_hex(32)
    if row is None:
        session.add(WebhookSecret(tenant=tenant, secret=fresh, created_at=utcnow()))
    else:
        row.secret, row.created_at = fresh, utcnow()
    session.commit()
    return fresh
