"""Webhook event filters: which notifications a job or a batch wants (``webhook_events``).

A filter names moments; the receiver sees event names (``X-Cloverq-Event`` and the body's
``event``). The final ones keep today's single ``job.finished`` event, whose body says the status,
so a receiver written for the default keeps working when a filter is added:

=================  ==================  =====================================================
filter             event sent          when
=================  ==================  =====================================================
``started``        ``job.started``     a worker claimed the job (once per job: its first claim)
``progress``       ``job.progress``    while it runs, at most one per
                                       ``webhooks.progress_interval_seconds`` per job (counters)
``succeeded``      ``job.finished``    final with that status
``failed``         ``job.finished``    final with that status
``cancelled``      ``job.finished``    final with that status
``batch_completed`` ``batch.finished`` every job of the batch is final (batches only)
=================  ==================  =====================================================

Default (no ``webhook_events``): today's behaviour, ``job.finished`` on any final status for a job
(= ``succeeded failed cancelled``) and ``batch.finished`` for a batch (= ``batch_completed``).
On a batch, the job filters apply to each of its jobs that has no ``webhook_url`` of its own (those
jobs are stored with the batch's URL and the job part of its filter). Stored as the names in the
order above, space-separated (``Job.webhook_events``, ``Batch.webhook_events``; NULL: default).
Pure functions: no SQL, no HTTP.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class EventFilter(enum.StrEnum):
    STARTED = "started"
    PROGRESS = "progress"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    BATCH_COMPLETED = "batch_completed"


ORDER: tuple[EventFilter, ...] = tuple(EventFilter)
JOB_FILTERS: tuple[EventFilter, ...] = tuple(f for f in ORDER if f is not EventFilter.BATCH_COMPLETED)
FINAL_FILTERS: frozenset[EventFilter] = frozenset(
    {EventFilter.SUCCEEDED, EventFilter.FAILED, EventFilter.CANCELLED})
DEFAULT_JOB: frozenset[EventFilter] = FINAL_FILTERS
DEFAULT_BATCH: frozenset[EventFilter] = frozenset({EventFilter.BATCH_COMPLETED})


class WebhookEventsError(ValueError):
    """A ``webhook_events`` list the service refuses (422)."""


def canonical(names: Iterable[str], *, batch: bool) -> str:
    """The stored form of a requested filter list; raises :class:`WebhookEventsError` for an
    unknown name, ``batch_completed`` on a job, or an empty list (leave the field out for the
    default)."""
    wanted: set[EventFilter] = set()
    for name in names:
        try:
            event = EventFilter(name)
        except ValueError:
            raise WebhookEventsError(f"unknown webhook event {name!r}; known: "
                                     f"{', '.join(f.value for f in ORDER)}") from None
        if event is EventFilter.BATCH_COMPLETED and not batch:
            raise WebhookEventsError("'batch_completed' is a batch's event (POST /v1/batches)")
        wanted.add(event)
    if not wanted:
        raise WebhookEventsError("name at least one webhook event (leave webhook_events out: the default)")
    return " ".join(f.value for f in ORDER if f in wanted)


def parse(stored: str | None, *, batch: bool = False) -> frozenset[EventFilter]:
    """The filters a stored value means (None: the default of a job or a batch)."""
    if stored is None:
        return DEFAULT_BATCH if batch else DEFAULT_JOB
    return frozenset(EventFilter(name) for name in stored.split())


def wants(stored: str | None, event: EventFilter, *, batch: bool = False) -> bool:
    return event in parse(stored, batch=batch)


def wants_final(stored: str | None, status: str) -> bool:
    """Whether a job with this filter sends ``job.finished`` for final ``status`` (``expired``
    is never a finish of its own: the job finished before)."""
    try:
        event = EventFilter(status)
    except ValueError:
        return False
    return event in FINAL_FILTERS and event in parse(stored)


def job_part(stored: str | None) -> str | None:
    """What a batch's filter asks of each of its jobs (stored on their rows): None when it names no
    job event, so those jobs keep the default of a job without a webhook (nothing)."""
    if stored is None:
        return None
    events = [f.value for f in ORDER if f in parse(stored, batch=True) and f in JOB_FILTERS]
    return " ".join(events) or None
