"""A job's or batch's delayed start and webhook events: checked (422) and turned into what is stored.

The request models check the shapes (an offset on ``not_before``, ``delay_seconds >= 0``, known
event names, ``webhook_events`` only with a ``webhook_url``); what depends on the deployment and
the clock is checked here, before admission, so a refusal stores and reserves nothing:
``not_before`` too far in the past or ahead, both fields at once (``422 invalid_schedule``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from api.errors import ApiError
from scheduler.infra.settings import Settings
from scheduler.jobs.models import utcnow
from scheduler.jobs.schedule import SCHEDULE_ERROR_CODE, ScheduleError, resolve_schedule
from scheduler.webhooks.events import WebhookEventsError, canonical

WEBHOOK_EVENTS_ERROR_CODE = "invalid_webhook_events"


def check_schedule(not_before: datetime | None, delay_seconds: float | None, *, settings: Settings,
                   now: datetime | None = None) -> datetime | None:
    """``scheduled_for`` of the request (None: start now); 422 ``invalid_schedule`` naming the field."""
    try:
        return resolve_schedule(not_before=not_before, delay_seconds=delay_seconds, now=now or utcnow(),
                                settings=settings)
    except ScheduleError as exc:
        raise ApiError(422, SCHEDULE_ERROR_CODE, str(exc),
                       [{"loc": ["body", exc.field], "message": str(exc), "type": "value_error"}]) from None


def schedule_request(not_before: datetime | None, delay_seconds: float | None) -> str | None:
    """The schedule as the client gave it, for the idempotency fingerprint (a delay is relative:
    a repeat of the same request must match although ``scheduled_for`` would differ)."""
    if not_before is not None:
        return f"not_before={not_before.isoformat()}"
    if delay_seconds is not None:
        return f"delay_seconds={delay_seconds!r}"
    return None


def stored_events(names: Sequence[str] | None, *, batch: bool) -> str | None:
    """The stored form of ``webhook_events`` (None: the default); 422 ``invalid_webhook_events``."""
    if names is None:
        return None
    try:
        return canonical(names, batch=batch)
    except WebhookEventsError as exc:
        details = [{"loc": ["body", "webhook_events"], "message": str(exc), "type": "value_error"}]
        raise ApiError(422, WEBHOOK_EVENTS_ERROR_CODE, str(exc), details) from None
