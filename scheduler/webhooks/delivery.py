"""Webhook delivery: one signed POST of an outbox row to its checked target, retried with backoff.

Deliveries are consumed from the separate ``webhooks`` queue by the light (model-less) worker
(``tasks.py``: ``cloverq.deliver_webhook(delivery_id)``), so a slow or dead endpoint can never
hold a GPU worker's thread. Each attempt re-checks the target (``ssrf_guard.resolve_target``),
signs the body (``signing.py``), POSTs to the checked address (redirects never followed, no
proxies from the environment) and records the attempt on the row, fenced on ``attempts``. A
failed POST is retried with exponential backoff (``webhook_backoff_seconds``); after
``webhook_max_attempts``, or at once for a refused target, the delivery is ``given_up``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import httpx
import structlog
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from scheduler.infra.db import rowcount
from scheduler.infra.settings import Settings
from scheduler.jobs.models import utcnow
from scheduler.jobs.retry import LATE_JITTER, exponential_backoff
from scheduler.webhooks.signing import SIGNATURE_HEADER, signature_header, tenant_secret
from scheduler.webhooks.ssrf_guard import (
    WebhookResolveError,
    WebhookTarget,
    WebhookTargetError,
    resolve_target,
)
from scheduler.webhooks.tables import DeliveryStatus, WebhookDelivery

log = structlog.get_logger(__name__)

DELIVER_WEBHOOK_TASK = "cloverq.deliver_webhook"
EVENT_HEADER = "X-Cloverq-Event"
DELIVERY_HEADER = "X-Cloverq-Delivery"


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
