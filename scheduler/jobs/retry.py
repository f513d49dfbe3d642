"""Retry policy: which faults are retried and how long to back off.

``exponential_backoff`` is the one backoff of the product: a job's retry (``backoff_seconds``, equal
jitter) and a webhook's next POST (``webhooks.delivery.webhook_backoff_seconds``, up to a quarter
later) differ only in their settings and their jitter range, so both call it.
"""

from __future__ import annotations

import random

from scheduler.infra.settings import Settings


class TransientJobError(Exception):
    """A fault worth retrying: device out of memory, worker lost, broker/database hiccup."""


class InputJobError(Exception):
    """The request itself is wrong; retrying cannot help."""


# Jitter ranges: the capped delay is multiplied by a uniform draw from [low, high].
EQUAL_JITTER: tuple[float, float] = (0.5, 1.0)  # half fixed, half random: jobs that failed together spread
LATE_JITTER: tuple[float, float] = (1.0, 1.25)  # never before the base, up to a quarter after it


def exponential_backoff(
    attempt: int,
    *,
    base_seconds: float,
    max_seconds: float,
    jitter: tuple[float, float],
    rng: random.Random | None = None,
) -> float:
    """Delay after failed attempt ``attempt`` (1-based): ``base_seconds * 2^(attempt-1)`` capped at
    ``max_seconds``, times a uniform draw from ``jitter`` (``rng``, else the module's generator).

    The jitter is a parameter because the two callers want different things: retries of jobs that
    failed together must spread out (``EQUAL_JITTER``), a webhook must never be retried sooner than its
    schedule says (``LATE_JITTER``).
    """
    low, high = jitter
    capped = min(max_seconds, base_seconds * 2 ** max(0, attempt - 1))
    return low * capped + (rng or random).uniform(0, (high - low) * capped)


def backoff_seconds(attempt: int, settings: Settings, *, rng: random.Random | None = None) -> float:
    """Delay before the retry that follows failed attempt ``attempt`` (1-based): the jobs' base and cap
    (``retry_backoff_*``) with equal jitter."""
    return exponential_backoff(
        attempt,
        base_seconds=settings.jobs.retry_backoff_base_seconds,
        max_seconds=settings.jobs.retry_backoff_max_seconds,
        jitter=EQUAL_JITTER,
        rng=rng,
    )
