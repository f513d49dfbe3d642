"""Names of every Redis key the job system uses (Celery's own keys aside), in one place."""

from __future__ import annotations

PREFIX = "cloverq"

# Set while a Celery message for the job is believed to exist; the reconciler re-enqueues
# queued jobs without one (Redis flushed, publish failed, retry due).
ENQUEUED_TTL_SECONDS = 24 * 3600  # a job queued longer gets a (harmless, fenced) duplicate
# Hot status of a job: JSON written by the worker at block boundaries.
PROGRESS_TTL_SECONDS = 24 * 3600
# A cancel signal lives long enough for any worker to notice it.
CANCEL_TTL_SECONDS = 24 * 3600

WORKERS_SET = f"{PREFIX}:workers"


def enqueued(job_id: object) -> str:
    return f"{PREFIX}:enqueued:{job_id}"


def progress(job_id: object) -> str:
    return f"{PREFIX}:progress:{job_id}"


def cancel(job_id: object) -> str:
    return f"{PREFIX}:cancel:{job_id}"


def worker(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


# Pub/sub channel: a job id is published when the job reaches a final status (job_events.py).
JOBS_FINISHED_CHANNEL = f"{PREFIX}:jobs:finished"
