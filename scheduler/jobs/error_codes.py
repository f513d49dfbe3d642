"""The stable error codes a failed job carries (``Job.error_code``, the API's ``error.code``).

A leaf module (no SQL, no Celery) so that pure code such as ``worker.decisions`` can name them;
``scheduler.jobs.models`` re-exports ``ErrorCode``.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Stable error codes written to ``Job.error_code``."""

    RETRIES_EXHAUSTED = "retries_exhausted"
    INVALID_INPUT = "invalid_input"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    INTERNAL = "internal_error"
    # decide jobs (worker/decisions/runner.py)
    INVALID_MODEL_OUTPUT = "invalid_model_output"  # a second invalid rationale
    BUDGET_EXHAUSTED = "budget_exhausted"  # the step budget ran out before every answer was decoded
    INCOMPLETE_OUTPUT = "incomplete_output"  # a sequence stopped before its answer was complete
