"""Plain ``jobs`` rows for tests that need many of them fast (one multi-row INSERT, no API).

Tests of set-wide statements (expiry batches, the canary tally's index) need hundreds or thousands
of rows in a given state; submitting them through the API would take most of the test's time.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import insert
from sqlalchemy.orm import Session

from scheduler.jobs.models import Job, utcnow


def job_row(**overrides: Any) -> dict[str, Any]:
    """One finished-looking ``generate`` row with every NOT NULL column filled; ``overrides`` win."""
    now = utcnow()
    row: dict[str, Any] = {
        "id": uuid.uuid4(), "tenant": "rows", "kind": "generate", "status": "succeeded",
        "priority": "bulk", "queue": "bulk", "cost": 1, "input": {"prompt": "p"}, "params": {},
        "result": {"text": "r"}, "steps_used": 0, "attempt": 1, "max_attempts": 3,
        "cancel_requested": False, "created_at": now, "available_at": now, "updated_at": now,
        "finished_at": now,
    }
    row.update(overrides)
    return row


def insert_rows(session: Session, rows: Sequence[dict[str, Any]]) -> None:
    """Insert ``rows`` (from :func:`job_row`) and commit."""
    session.execute(insert(Job), list(rows))
    session.commit()
