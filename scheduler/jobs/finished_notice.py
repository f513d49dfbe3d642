"""A Redis pub/sub notice that a job reached a final status, for long-polling readers.

``GET /v1/jobs/{id}?wait=S`` (``api.job_waiter``) sleeps until such a notice or its re-check
interval, then reads the job row. SQL stays the only truth: a notice only wakes a reader
early, and a lost one (no subscriber yet, a Redis blip, a final status written by the beat's
reaper or expiry, which do not publish) costs the reader at most one re-check interval, never
a wrong answer. Publishing is fire-and-forget for the same reason.
"""

from __future__ import annotations

import uuid

import redis
import structlog

from scheduler.infra.redis_keys import JOBS_FINISHED_CHANNEL

log = structlog.get_logger(__name__)


def publish_finished(client: redis.Redis, job_id: uuid.UUID | str) -> None:
    """Tell long-polling readers that ``job_id`` is final (call after the SQL commit)."""
    try:
        client.publish(JOBS_FINISHED_CHANNEL, str(job_id))
    except redis.RedisError as exc:
        log.info("job.finished_notice_failed", job_id=str(job_id), error=type(exc).__name__)
