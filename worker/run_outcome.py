"""What the worker did with one job message (``WorkerRuntime.run_job``'s return: logs, tests).

Never stored: the job's own outcome is its ``JobStatus`` and ``ErrorCode`` in SQL.
"""

from __future__ import annotations

import enum

from scheduler.jobs.models import JobStatus


class RunOutcome(enum.StrEnum):
    INVALID = "invalid"  # the message carried no job id
    HANDED_BACK = "handed_back"  # not claimed (draining, class cap, model switch): republished later
    SKIPPED = "skipped"  # not claimable: a duplicate, cancelled or not due
    LOST = "lost"  # the attempt no longer owns the job (reaped, handed back): nothing written
    # the attempt's outcome was written: the job's final status
    SUCCEEDED = JobStatus.SUCCEEDED.value
    FAILED = JobStatus.FAILED.value
    CANCELLED = JobStatus.CANCELLED.value
    # a transient fault: queued again with backoff, or failed with retries_exhausted
    RETRY_QUEUED = f"retry:{JobStatus.QUEUED.value}"
    RETRY_FAILED = f"retry:{JobStatus.FAILED.value}"

    @classmethod
    def finished(cls, status: JobStatus) -> RunOutcome:
        """The outcome of an attempt whose final ``status`` was written."""
        return cls(status.value)

    @classmethod
    def retried(cls, status: JobStatus) -> RunOutcome:
        """The outcome of a transient fault after ``retry_or_fail`` returned ``status``."""
        return cls(f"retry:{status.value}")
