"""Webhooks: a signed POST when a job (or a whole batch) finishes, retried with backoff.

Delivery is an outbox: finishing a job inserts a ``webhook_deliveries`` row (unique per event
and job/batch, so a duplicate finish never sends twice) and publishes
``cloverq.deliver_webhook(delivery_id)`` to the separate ``webhooks`` queue, consumed by the
light (model-less) worker — a slow or dead endpoint can never hold a GPU worker's thread.
A failed POST is retried with exponential backoff; after ``webhook_max_attempts`` the delivery
is ``given_up``. The job row is never touched by any of this.

Signature: ``X-Cloverq-Signature: t=<unix ts>,v1=<hex HMAC-SHA256(secret, "<ts>." + body)>``,
with a per-tenant secret (``webhook_secrets``; ``GET /v1/webhooks/secret`` shows it to the
tenant). Receivers recompute the HMAC over the raw body and reject old timestamps (replays).

Targets (SSRF): a webhook URL is a request the service makes on a client's behalf, so it may
only reach the public internet. :func:`check_url` (at submit, no DNS) refuses other schemes,
credentials in the URL, ``localhost`` names and literal non-public addresses;
:func:`resolve_target` (at every delivery) resolves the host, refuses the delivery when ANY of
its addresses is loopback, private, link-local (cloud metadata), multicast, unspecified,
reserved or otherwise not globally routable, and the POST then connects to exactly the address
that was checked (no second lookup an attacker's DNS could answer differently). Redirects are
never followed and proxies from the environment are not used. ``settings.webhooks.allowed_hosts``
/ ``webhook_allowed_networks`` name the exceptions (an internal receiver, tests on 127.0.0.1).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import json
import secrets
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any

import httpx
import structlog
from sqlalchemy import Index, Integer, String, Text, UniqueConstraint, Uuid, func, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from scheduler.infra.db import rowcount
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Base, Job, JobStatus, JSONType, UTCDateTime, utcnow
from scheduler.jobs.retry import LATE_JITTER, exponential_backoff
from scheduler.webhooks.events import wants_final

log = structlog.get_logger(__name__)

DELIVER_WEBHOOK_TASK = "cloverq.deliver_webhook"
SIGNATURE_HEADER = "X-Cloverq-Signature"
EVENT_HEADER = "X-Cloverq-Event"
DELIVERY_HEADER = "X-Cloverq-Delivery"
DEFAULT_TOLERANCE_SECONDS = 300


class WebhookEvent(enum.StrEnum):
    """What the receiver sees in ``X-Cloverq-Event`` (which filter sends which: ``events.py``)."""

    JOB_FINISHED = "job.finished"
    BATCH_FINISHED = "batch.finished"
    JOB_STARTED = "job.started"  # only with webhook_events naming "started"
    JOB_PROGRESS = "job.progress"  # only with "progress"


class DeliveryStatus(enum.StrEnum):
    PENDING = "pending"
    DELIVERED = "delivered"
    GIVEN_UP = "given_up"


class WebhookSecret(Base):
    """The signing secret of one tenant (created on first use)."""

    __tablename__ = "webhook_secrets"

    tenant: Mapped[str] = mapped_column(String(128), primary_key=True)
    secret: Mapped[str] = mapped_column(String(128), nullable=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)


class WebhookDelivery(Base):
    """One notification to send (the outbox row) and how its attempts went."""

    __tablename__ = "webhook_deliveries"

    id: Mapped[uuid.UUID] = mapped_column(Uuid(as_uuid=True), primary_key=True, default=uuid.uuid4)
    tenant: Mapped[str] = mapped_column(String(128), nullable=False)
    event: Mapped[str] = mapped_column(String(32), nullable=False)
    job_id: Mapped[uuid.UUID | None] = mapped_column(Uuid(as_uuid=True), nullable=True)
    batch_id: Mapped[uuid.UUID | None] = mapped_column(Uuid(as_uuid=True), nullable=True)
    # 0 for every event but ``job.progress``, whose deliveries of one job are numbered (the
    # throttle's time bucket, scheduler/webhooks/progress.py): unique per event, job and sequence.
    sequence: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default=text("0"))
    url: Mapped[str] = mapped_column(Text, nullable=False)
    payload: Mapped[dict[str, Any]] = mapped_column(JSONType, nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False, default=DeliveryStatus.PENDING.value)
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    __table_args__ = (
        UniqueConstraint("event", "job_id", "sequence", name="uq_webhook_deliveries_event_job_sequence"),
        UniqueConstraint("event", "batch_id", name="uq_webhook_deliveries_event_batch"),
        Index("ix_webhook_deliveries_status_next", "status", "next_attempt_at"),
    )


# --- signing ------------------------------------------------------------------------------------


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


# --- outbox ------------------------------------------------------------------------------------


def job_payload(job: Job) -> dict[str, Any]:
    """What a job webhook carries: enough to act without polling."""
    return {
        "event": WebhookEvent.JOB_FINISHED.value,
        "job": {
            "id": str(job.id),
            "kind": job.kind,
            "status": job.status,
            "batch_id": str(job.batch_id) if job.batch_id else None,
            "metadata": job.meta,
            "result": job.result,
            "error": {"code": job.error_code, "message": job.error_message} if job.error_code else None,
            "finished_at": job.finished_at.isoformat() if job.finished_at else None,
        },
    }


def _insert_once(session: Session, delivery: WebhookDelivery) -> uuid.UUID | None:
    try:
        with session.begin_nested():
            session.add(delivery)
    except IntegrityError:  # this event was already recorded (duplicate finish)
        return None
    return delivery.id


def record_job_finished(
    session: Session, *, job: Job, batch_payload: Callable[[Session, uuid.UUID], tuple[str, dict] | None]
    | None = None,
) -> list[uuid.UUID]:
    """Insert the deliveries a finished job triggers (its own, and its batch's when it was the
    batch's last). The caller commits, then publishes the returned ids."""
    ids: list[uuid.UUID] = []
    now = utcnow()
    if job.webhook_url and wants_final(job.webhook_events, job.status):
        delivery_id = _insert_once(
            session,
            WebhookDelivery(
                id=uuid.uuid4(), tenant=job.tenant, event=WebhookEvent.JOB_FINISHED.value, job_id=job.id,
                url=job.webhook_url, payload=job_payload(job), status=DeliveryStatus.PENDING.value,
                attempts=0, next_attempt_at=now, created_at=now,
            ),
        )
        if delivery_id:
            ids.append(delivery_id)
    if job.batch_id and batch_payload is not None:
        unfinished = session.scalar(
            select(func.count()).select_from(Job).where(
                Job.batch_id == job.batch_id,
                Job.status.in_((JobStatus.QUEUED.value, JobStatus.RUNNING.value)),
            )
        )
        built = batch_payload(session, job.batch_id) if not unfinished else None
        if built is not None:
            url, payload = built
            delivery_id = _insert_once(
                session,
                WebhookDelivery(
                    id=uuid.uuid4(), tenant=job.tenant, event=WebhookEvent.BATCH_FINISHED.value,
                    batch_id=job.batch_id, url=url, payload=payload, status=DeliveryStatus.PENDING.value,
                    attempts=0, next_attempt_at=now, created_at=now,
                ),
            )
            if delivery_id:
                ids.append(delivery_id)
    return ids


# --- targets (SSRF) -----------------------------------------------------------------------------

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Sequence[str]]

# Instance metadata services (AWS/GCP/Azure/OpenStack, AWS IPv6, ECS task metadata, Alibaba):
# all in refused ranges anyway; named so the refusal says what it protected.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(address) for address in (
    "169.254.169.254", "fd00:ec2::254", "169.254.170.2", "100.100.100.200",
))
LOCALHOST_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


class WebhookTargetError(ValueError):
    """A webhook URL the service never sends to (refused at submit and at delivery)."""


class WebhookResolveError(OSError):
    """The webhook host does not resolve right now (a failed attempt, retried)."""


def _address(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _normal_host(host: str) -> str:
    return host.lower().rstrip(".").strip("[]")


@lru_cache(maxsize=16)
def _networks(cidrs: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(cidr, strict=False) for cidr in cidrs)


def refused_reason(address: str | IPAddress, settings: Settings) -> str | None:
    """Why webhook traffic may not go to ``address``; None when it may (public, or allow-listed).

    An IPv4 address embedded in IPv6 (``::ffff:127.0.0.1``, 6to4) is judged as that IPv4
    address. ``settings.webhooks.allowed_networks`` overrides every refusal.
    """
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        ip = ipaddress.IPv6Address(str(ip).split("%", 1)[0])
    embedded = (ip.ipv4_mapped or ip.sixtofour) if isinstance(ip, ipaddress.IPv6Address) else None
    judged = embedded or ip
    allowed = _networks(tuple(settings.webhooks.allowed_networks))
    if any(ip in network or judged in network for network in allowed):
        return None
    if judged in METADATA_ADDRESSES or ip in METADATA_ADDRESSES:
        return "a cloud metadata address"
    for flag, reason in (
        ("is_unspecified", "an unspecified"), ("is_loopback", "a loopback"),
        ("is_link_local", "a link-local"), ("is_multicast", "a multicast"), ("is_private", "a private"),
        ("is_reserved", "a reserved"),
    ):
        if getattr(judged, flag) or getattr(ip, flag):
            return f"{reason} address"
    if not judged.is_global or not ip.is_global:
        return "not a public address"
    return None


def check_url(url: str, settings: Settings) -> httpx.URL:
    """What can be known about a webhook URL without DNS (at submit, and again at delivery).

    Raises :class:`WebhookTargetError` for a scheme other than http/https, a missing host,
    credentials in the URL (they would be sent to the target as Basic auth, and logged), and a
    host that is a ``localhost`` name or a literal address :func:`refused_reason` refuses —
    unless ``settings.webhooks.allowed_hosts`` names the host.
    """
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise WebhookTargetError(f"not a valid URL: {exc}") from None
    if parsed.scheme not in ("http", "https"):
        raise WebhookTargetError("the URL must be http or https")
    if not parsed.host:
        raise WebhookTargetError("the URL has no host")
    if parsed.userinfo:
        raise WebhookTargetError("the URL must not carry credentials (user:password@)")
    host = _normal_host(parsed.host)
    if host in settings.webhooks.allowed_hosts:
        return parsed
    literal = _address(host)
    if literal is not None:
        reason = refused_reason(literal, settings)
        if reason is not None:
            raise WebhookTargetError(f"{host} is {reason}")
    elif host in LOCALHOST_NAMES or host.endswith(".localhost"):
        raise WebhookTargetError(f"{host} is a loopback name")
    return parsed


def _resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the system resolver)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise WebhookResolveError(f"{host} does not resolve: {exc}") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True)
class WebhookTarget:
    """A checked webhook URL and the addresses (all checked) its POST may connect to, in order."""

    url: httpx.URL
    addresses: tuple[str, ...]

    @property
    def address(self) -> str:
        """The address tried first."""
        return self.addresses[0]

    def request_url(self, address: str | None = None) -> httpx.URL:
        """The URL with its host replaced by a checked address (no second DNS lookup)."""
        return self.url.copy_with(host=(address or self.address).split("%", 1)[0])

    @property
    def headers(self) -> dict[str, str]:
        return {"Host": self.url.netloc.decode("ascii")}

    @property
    def extensions(self) -> dict[str, Any]:
        """TLS: SNI and certificate check against the URL's host name, not the address."""
        if self.url.scheme == "https" and _address(_normal_host(self.url.host)) is None:
            return {"sni_hostname": self.url.raw_host.decode("ascii")}
        return {}


def resolve_target(url: str, settings: Settings, *, resolver: Resolver | None = None) -> WebhookTarget:
    """Check ``url`` and its host's addresses now (at delivery); see the module docstring.

    Raises :class:`WebhookTargetError` (never delivered: any address refused) or
    :class:`WebhookResolveError` (no address now: retried). ``resolver(host, port)`` defaults to
    the system resolver.
    """
    parsed = check_url(url, settings)
    host = _normal_host(parsed.host)
    literal = _address(host)
    if literal is not None:
        addresses: Sequence[str] = [str(literal)]
    else:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        addresses = list((resolver or _resolve)(host, port))
        if not addresses:
            raise WebhookResolveError(f"{host} resolves to no address")
    if host not in settings.webhooks.allowed_hosts:
        for address in addresses:
            reason = refused_reason(address, settings)
            if reason is not None:
                shown = host if literal is not None else f"{host} resolves to {address}, which"
                raise WebhookTargetError(f"{shown} is {reason}")
    return WebhookTarget(url=parsed, addresses=tuple(str(address) for address in addresses))


# --- delivery ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeliveryStep:
    """Outcome of one attempt: the status now, and when to try again (None = done)."""

    status: DeliveryStatus
    retry_in_seconds: float | None
    status_code: int | None = None
    error: str | None = None


def webhook_backoff_seconds(attempts: int, settings: Settings) -> float:
    """Delay before attempt ``attempts + 1``: the jobs' ``exponential_backoff`` with the webhook base and
    cap, +0-25% jitter (``LATE_JITTER``: never sooner than the schedule)."""
    return exponential_backoff(
        attempts,
        base_seconds=settings.webhooks.backoff_base_seconds,
        max_seconds=settings.webhooks.backoff_max_seconds,
        jitter=LATE_JITTER,
    )


def _post(
    target: WebhookTarget, body: bytes, headers: Mapping[str, str], timeout: float
) -> tuple[int | None, str | None]:
    """One POST to a checked address (the next one only when connecting failed, as a plain
    connect would); a redirect is an answer like any other (not followed)."""
    # trust_env=False: no proxy or .netrc from the environment (the checked address is the peer).
    with httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client:
        for index, address in enumerate(target.addresses):
            try:
                response = client.post(target.request_url(address), content=body,
                                       headers={**headers, **target.headers}, extensions=target.extensions)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if index + 1 == len(target.addresses):
                    return None, f"{type(exc).__name__}: {exc}"
            except httpx.HTTPError as exc:
                return None, f"{type(exc).__name__}: {exc}"
    if 200 <= response.status_code < 300:
        return response.status_code, None
    if response.is_redirect:
        return response.status_code, f"HTTP {response.status_code} (redirects are not followed)"
    return response.status_code, f"HTTP {response.status_code}"


def _attempt(url: str, body: bytes, headers: Mapping[str, str], settings: Settings) -> tuple[
    int | None, str | None, bool
]:
    """``(status code, error, refused)``: the target is checked before anything is sent."""
    try:
        target = resolve_target(url, settings)
    except WebhookTargetError as exc:
        return None, f"refused target: {exc}", True
    except WebhookResolveError as exc:
        return None, str(exc), False
    code, error = _post(target, body, headers, settings.webhooks.timeout_seconds)
    return code, error, False


def deliver_once(
    sessions: sessionmaker[Session], *, delivery_id: uuid.UUID | str, settings: Settings
) -> DeliveryStep:
    """Try one POST of a pending delivery and record the attempt (fenced on ``attempts``)."""
    with sessions() as session:
        delivery = session.get(WebhookDelivery, uuid.UUID(str(delivery_id)))
        if delivery is None or delivery.status != DeliveryStatus.PENDING.value:
            status = DeliveryStatus(delivery.status) if delivery else DeliveryStatus.GIVEN_UP
            return DeliveryStep(status=status, retry_in_seconds=None)
        secret = tenant_secret(session, tenant=delivery.tenant)
        body = json.dumps(delivery.payload, sort_keys=True, separators=(",", ":")).encode()
        headers = {
            "Content-Type": "application/json",
            SIGNATURE_HEADER: signature_header(secret, int(time.time()), body),
            EVENT_HEADER: delivery.event,
            DELIVERY_HEADER: str(delivery.id),
            "User-Agent": "cloverq-webhooks/1",
        }
        url, seen_attempts = delivery.url, delivery.attempts

    code, error, refused = _attempt(url, body, headers, settings)
    attempts = seen_attempts + 1
    now = utcnow()
    if error is None:
        step = DeliveryStep(DeliveryStatus.DELIVERED, None, code)
    elif refused or attempts >= settings.webhooks.max_attempts:  # a refused target is never retried
        step = DeliveryStep(DeliveryStatus.GIVEN_UP, None, code, error)
    else:
        step = DeliveryStep(DeliveryStatus.PENDING, webhook_backoff_seconds(attempts, settings), code, error)
    next_at = now + timedelta(seconds=step.retry_in_seconds or 0)
    with sessions() as session:
        updated = rowcount(session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.id == uuid.UUID(str(delivery_id)),
                   WebhookDelivery.attempts == seen_attempts,
                   WebhookDelivery.status == DeliveryStatus.PENDING.value)
            .values(attempts=attempts, status=step.status.value, last_status_code=code, last_error=error,
                    next_attempt_at=next_at,
                    finished_at=None if step.status is DeliveryStatus.PENDING else now)
        ))
        session.commit()
    if not updated:  # a duplicate message raced us and recorded this attempt: let it drive retries
        return DeliveryStep(step.status, None, code, error)
    event = "webhook.delivered" if error is None else "webhook.attempt_failed"
    if step.status is DeliveryStatus.GIVEN_UP:
        event = "webhook.given_up"
    log.info(event, delivery_id=str(delivery_id), attempt=attempts, status_code=code, error=error,
             retry_in=step.retry_in_seconds)
    return step


def due_deliveries(session: Session, *, older_than_seconds: float, limit: int = 500) -> list[uuid.UUID]:
    """Pending deliveries overdue by ``older_than_seconds`` (their message was lost): the
    sweeper publishes them again."""
    cutoff = utcnow() - timedelta(seconds=older_than_seconds)
    return list(
        session.scalars(
            select(WebhookDelivery.id)
            .where(WebhookDelivery.status == DeliveryStatus.PENDING.value,
                   WebhookDelivery.next_attempt_at < cutoff)
            .limit(limit)
        )
    )
