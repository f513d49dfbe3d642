"""Retry policy: which faults are retried and how long to back off."""

from __future__ import annotations

import random

from scheduler.settings import Settings


class TransientJobError(Exception):
    """A fault worth retrying: device out of memory, worker lost, broker/database hiccup."""


class InputJobError(Exception):
    """The request itself is wrong; retrying cannot help."""


def backoff_seconds(attempt: int, settings: Settings, *, rng: random.Random | None = None) -> float:
    """Delay before the retry that follows failed attempt ``attempt`` (1-based).

    Exponential (base * 2^(attempt-1)) capped at ``retry_backoff_max_seconds``, with "equal
    jitter": half fixed, half random, so retries of jobs that failed together spread out.
    """
    base = min(settings.jobs.retry_backoff_max_seconds,
               settings.jobs.retry_backoff_base_seconds * 2 ** max(0, attempt - 1))
    return base / 2 + (rng or random).uniform(0, base / 2)
