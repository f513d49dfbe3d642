"""Delayed jobs: which ``not_before`` / ``delay_seconds`` are accepted and what they resolve to (pure),
and the request models' shape checks (scheduler/jobs/schedule.py, api/schemas)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import TypeAdapter, ValidationError

from api.schemas.batches import BatchOptions
from api.schemas.jobs import JobCreate
from scheduler.infra.settings import Settings
from scheduler.jobs.schedule import ScheduleError, is_delayed, resolve_schedule

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
SETTINGS = Settings(delay_past_tolerance_seconds=60, delay_max_seconds=3600)


def resolve(not_before: datetime | None = None, delay: float | None = None) -> datetime | None:
    return resolve_schedule(not_before=not_before, delay_seconds=delay, now=NOW, settings=SETTINGS)


def test_neither_or_a_zero_delay_means_now() -> None:
    assert resolve() is None
    assert resolve(delay=0) is None


def test_a_delay_or_a_time_gives_the_start() -> None:
    assert resolve(delay=2.5) == NOW + timedelta(seconds=2.5)
    later = NOW + timedelta(minutes=5)
    assert resolve(not_before=later) == later
    # another offset is the same instant, returned in UTC
    plus_two = datetime.fromisoformat("2030-01-01T00:00+02:00").tzinfo
    assert resolve(not_before=later.astimezone(plus_two)) == later
    assert is_delayed(later, NOW) and not is_delayed(NOW, NOW) and not is_delayed(None, NOW)


def test_a_little_in_the_past_is_clock_skew_and_starts_at_once() -> None:
    skewed = NOW - timedelta(seconds=59)
    assert resolve(not_before=skewed) == skewed
    assert not is_delayed(skewed, NOW)


def test_the_limit_is_said_as_a_person_reads_it() -> None:
    """The default 30 days were said as "2.592e+06 s"."""
    month = Settings(delay_max_seconds=2_592_000)
    with pytest.raises(ScheduleError, match=r"more than 2592000 s \(30 days\) ahead"):
        resolve_schedule(not_before=NOW + timedelta(days=31), delay_seconds=None, now=NOW, settings=month)
    with pytest.raises(ScheduleError, match=r"at most 3600 s \(1 hour\)"):
        resolve(delay=3601)


@pytest.mark.parametrize(("not_before", "delay", "field"), [
    (NOW - timedelta(seconds=61), None, "not_before"),  # past beyond the tolerance
    (NOW + timedelta(seconds=3601), None, "not_before"),  # beyond the maximum
    (None, 3601, "delay_seconds"),
    (None, 1e300, "delay_seconds"),  # no timedelta holds it: a 422, never a 500
    (None, -1, "delay_seconds"),
    (None, float("inf"), "delay_seconds"),
    (None, float("nan"), "delay_seconds"),
    (NOW + timedelta(seconds=5), 5, "not_before"),  # both
    (datetime(2030, 1, 1, 12, 5), None, "not_before"),  # no offset
])
def test_refused(not_before: datetime | None, delay: float | None, field: str) -> None:
    with pytest.raises(ScheduleError) as refused:
        resolve(not_before=not_before, delay=delay)
    assert refused.value.field == field


BODY = {"kind": "generate", "input": {"prompt": "hi"}}
HOOK = "https://example.com/hook"


@pytest.mark.parametrize("extra", [
    {"delay_seconds": -1},
    {"delay_seconds": "inf"},
    {"not_before": "2030-01-01T12:00:00"},  # no offset
    {"webhook_events": ["started"]},  # no webhook_url
    {"webhook_url": HOOK, "webhook_events": ["bogus"]},
    {"webhook_url": HOOK, "webhook_events": ["batch_completed"]},  # a batch's event
    {"webhook_url": HOOK, "webhook_events": []},
])
def test_job_models_refuse_bad_shapes(extra: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        TypeAdapter(JobCreate).validate_python({**BODY, **extra})


def test_batch_options_take_comma_separated_events_and_batch_completed() -> None:
    options = BatchOptions.model_validate({"webhook_url": HOOK, "webhook_events": "started, batch_completed",
                                           "delay_seconds": "2"})
    assert options.webhook_events == ["started", "batch_completed"] and options.delay_seconds == 2.0
    with pytest.raises(ValidationError):
        BatchOptions.model_validate({"webhook_events": ["batch_completed"]})  # no webhook_url
    with pytest.raises(ValidationError):
        BatchOptions.model_validate({"webhook_url": HOOK, "webhook_events": "nope"})
