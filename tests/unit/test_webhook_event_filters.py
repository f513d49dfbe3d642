"""Webhook event filters (scheduler/webhooks/events.py) and the progress throttle
(scheduler/webhooks/progress.py): pure logic."""

from __future__ import annotations

import pytest

from scheduler.webhooks.events import EventFilter, WebhookEventsError, canonical, job_part, wants, wants_final
from scheduler.webhooks.progress import ProgressThrottle


def test_canonical_orders_and_deduplicates() -> None:
    assert canonical(["succeeded", "started", "succeeded"], batch=False) == "started succeeded"
    assert canonical(["batch_completed", "progress"], batch=True) == "progress batch_completed"


@pytest.mark.parametrize(("names", "batch"), [(["nope"], False), (["batch_completed"], False), ([], True)])
def test_canonical_refuses(names: list[str], batch: bool) -> None:
    with pytest.raises(WebhookEventsError):
        canonical(names, batch=batch)


def test_default_is_todays_behaviour() -> None:
    for status in ("succeeded", "failed", "cancelled"):
        assert wants_final(None, status)
    assert not wants_final(None, "expired") and not wants_final(None, "running")
    assert not wants(None, EventFilter.STARTED) and not wants(None, EventFilter.PROGRESS)
    assert wants(None, EventFilter.BATCH_COMPLETED, batch=True)
    assert not wants(None, EventFilter.BATCH_COMPLETED)  # a job alone has no batch event


def test_a_filter_sends_only_what_it_names() -> None:
    stored = canonical(["started", "succeeded"], batch=False)
    assert wants(stored, EventFilter.STARTED) and not wants(stored, EventFilter.PROGRESS)
    assert wants_final(stored, "succeeded") and not wants_final(stored, "failed")
    assert not wants_final(stored, "cancelled")


def test_a_batch_filter_splits_into_the_jobs_part() -> None:
    assert job_part(None) is None
    assert job_part("batch_completed") is None
    assert job_part("started failed batch_completed") == "started failed"
    assert not wants("started", EventFilter.BATCH_COMPLETED, batch=True)


def test_throttle_sends_at_most_one_per_interval_and_only_when_counters_moved() -> None:
    throttle = ProgressThrottle(interval=10.0)
    first = throttle.take(1000.0, (1,))
    assert first == 100
    assert throttle.take(1005.0, (2,)) is None  # too soon
    assert throttle.take(1011.0, (2,)) == 101  # an interval later: the next bucket
    assert throttle.take(1030.0, (2,)) is None  # nothing moved
    assert throttle.take(1030.5, (3,)) == 103


def test_throttle_buckets_never_repeat_and_count_from_the_jobs_creation() -> None:
    created = 1_900_000_000.0  # a unix time: buckets stay small numbers (an INTEGER column)
    throttle = ProgressThrottle(interval=0.7, origin=created)
    sequences = [throttle.take(created + t / 10, (t,)) for t in range(0, 200)]
    sent = [s for s in sequences if s is not None]
    assert sent[0] == 0 and len(sent) == len(set(sent)) and len(sent) >= 20 and max(sent) < 100
