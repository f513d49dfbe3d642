"""The ``progress`` webhook's throttle: at most one ``job.progress`` per interval per job.

A job's progress changes every block (several times a second); a receiver asked for a heartbeat
of it, not a stream (``GET /v1/jobs/{id}/events`` is the stream). The worker's monitor thread asks
:meth:`ProgressThrottle.take` on its tick and records a delivery only when it answers a sequence.

Two guards, one per failure mode:

- in the process: ``take`` answers at most once per ``interval`` (wall clock), and only when the
  job's counters moved since the last one sent (a stalled job sends nothing new);
- in SQL: the answer is the time bucket ``floor((now - origin) / interval)``, with ``origin`` the
  job's ``created_at`` (the same on every worker, and small numbers for the INTEGER column), the
  delivery's ``sequence``; ``webhook_deliveries`` is unique per (event, job, sequence): two takes at
  least an interval apart fall in different buckets, and a second attempt of the job (another
  worker after a retry) can never send two in one bucket. So a receiver gets at most one per
  bucket, and never two closer than the interval from one attempt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class ProgressThrottle:
    """Per-job throttle state; ``take`` is called from one thread (the monitor's)."""

    interval: float
    origin: float = 0.0  # unix seconds the buckets count from (the job's created_at)
    _last_sent: float | None = None
    _last_counters: tuple[Any, ...] | None = None

    def take(self, now: float, counters: tuple[Any, ...]) -> int | None:
        """The sequence (time bucket) to record a progress delivery under, or None: too soon
        after the last one, or nothing moved since it."""
        if counters == self._last_counters:
            return None
        if self._last_sent is not None and now - self._last_sent < self.interval:
            return None
        self._last_sent, self._last_counters = now, counters
        return math.floor((now - self.origin) / self.interval)


@dataclass
class ProgressWebhook:
    """What the monitor needs to send a running job's ``job.progress`` (set at claim when the
    job's ``webhook_events`` name ``progress``)."""

    tenant: str
    url: str
    kind: str
    batch_id: str | None
    metadata: dict[str, Any] | None
    throttle: ProgressThrottle
