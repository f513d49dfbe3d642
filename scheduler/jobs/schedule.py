"""Delayed jobs: when a job may start (``not_before`` / ``delay_seconds``) and what holds it back.

A delayed job is an ordinary ``queued`` row with ``scheduled_for`` set and ``available_at`` (the
time every path that starts a job already waits for: the reconciler, aging, the claim's own
``available_at <= now`` fence) starting at that same time instead of now. Its message is not sent
at submit; the beat's delayed tick (``scheduler/maintenance/delayed.py``, every
``beat.delayed_interval_seconds``) publishes it when it comes due, and the reconciler stays the
backstop for any due row without a message. Nothing else is special: cancel is the queued
cancel, ``status`` stays ``queued`` (the JSON shows ``scheduled_for``).

Caps, the honest rule: a delayed job counts against the tenant's cap of queued + running jobs from
its submission until it is final, because that cap is counted in SQL and the row is ``queued``
all along. The admission's Redis reservations (``scheduler.access.admission``: the job's queue and
tenant reservations and its enqueued marker) are released right after the commit
(:func:`release_admission`): from then on SQL counts the job, no message will ever release them,
and left alone they would count it twice until they expire. The queue depth cap is checked at
submission like any job's; while it waits the job is in no broker list, so it occupies no depth,
and when it comes due it joins its queue without a second check (an accepted job is never refused).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime, timedelta

import redis

from scheduler.infra import redis_keys
from scheduler.infra.settings import Settings
from scheduler.jobs.models import as_utc

SCHEDULE_ERROR_CODE = "invalid_schedule"


class ScheduleError(ValueError):
    """A ``not_before`` / ``delay_seconds`` the service refuses (422 ``invalid_schedule``)."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


def resolve_schedule(
    *, not_before: datetime | None, delay_seconds: float | None, now: datetime, settings: Settings,
) -> datetime | None:
    """The time a job may start (``scheduled_for``), or None for "now" (neither field, or a zero delay).

    Raises :class:`ScheduleError` when both are given, the delay is negative or not finite,
    ``not_before`` lies more than ``jobs.delay_past_tolerance_seconds`` in the past (a little is
    clock skew between client and server: such a job starts at once) or either asks for a start
    later than ``jobs.delay_max_seconds`` from now.
    """
    if not_before is not None and delay_seconds is not None:
        raise ScheduleError("give not_before or delay_seconds, not both", field="not_before")
    maximum = timedelta(seconds=settings.jobs.delay_max_seconds)
    if delay_seconds is not None:
        if not math.isfinite(delay_seconds) or delay_seconds < 0:
            raise ScheduleError("delay_seconds must be a finite number >= 0", field="delay_seconds")
        if delay_seconds > settings.jobs.delay_max_seconds:  # compared as numbers: 1e300 is no timedelta
            raise ScheduleError(f"delay_seconds may be at most {_seconds(maximum)} "
                                "(settings.jobs.delay_max_seconds)", field="delay_seconds")
        return now + timedelta(seconds=delay_seconds) if delay_seconds > 0 else None
    if not_before is None:
        return None
    try:
        due = as_utc(not_before)
    except ValueError as exc:
        raise ScheduleError(f"not_before: {exc}", field="not_before") from None
    tolerance = settings.jobs.delay_past_tolerance_seconds
    if due < now - timedelta(seconds=tolerance):
        raise ScheduleError(f"not_before lies {(now - due).total_seconds():.0f} s in the past; at most "
                            f"{tolerance:g} s is accepted (settings.jobs.delay_past_tolerance_seconds)",
                            field="not_before")
    if due > now + maximum:
        raise ScheduleError(f"not_before is more than {_seconds(maximum)} ahead "
                            "(settings.jobs.delay_max_seconds)", field="not_before")
    return due


def _seconds(span: timedelta) -> str:
    """A limit as a person reads it: ``2592000 s (30 days)``, not ``2.592e+06``."""
    seconds = span.total_seconds()
    whole = f"{seconds:.0f}" if seconds == int(seconds) else f"{seconds:g}"
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= size:
            count = seconds / size
            return f"{whole} s ({count:g} {unit if count != 1 else unit[:-1]})"
    return f"{whole} s"


def is_delayed(scheduled_for: datetime | None, now: datetime) -> bool:
    """Whether a job with this ``scheduled_for`` must wait (else it is published at submit)."""
    return scheduled_for is not None and scheduled_for > now


def release_admission(client: redis.Redis, *, tenant: str, jobs: Sequence[tuple[object, str]]) -> None:
    """Drop the admission's enqueued marker and reservations of delayed jobs just committed,
    ``(job_id, queue)`` each, in one pipeline (see the module docstring). Raises
    ``redis.RedisError``; left alone the reservations expire within a minute, and a marker hides
    the job from the delayed tick and the reconciler until ``release_lost_messages`` finds no
    message for it (a job due for more than a lease)."""
    with client.pipeline(transaction=False) as pipe:
        for job_id, queue in jobs:
            marker = redis_keys.enqueued(job_id)
            pipe.delete(marker)
            pipe.zrem(redis_keys.queue_reservations(queue), marker)
            pipe.zrem(redis_keys.tenant_reservations(tenant), marker)
        pipe.execute()
