"""Aging under fair share: the aged jobs promoted come from every tenant in turn, by weight.

Aging (``scheduler/maintenance/tasks.py`` ``promote_aged_jobs``) bounds starvation between
classes: a job queued longer than ``aging_seconds`` moves to ``interactive``. Oldest-first would
undo fair share inside the class: the tenant that submitted a big batch first owns all of the
oldest jobs, and aging would hand it every promotion. So with fair share on, the candidates are
each tenant's own oldest jobs, interleaved by rank over weight (a tenant of weight 3 gets three
promotions for another's one), and a promoted job leaves the held index of its old class.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import redis
import structlog
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from scheduler.fairness.held import HeldJob, forget, submission_order
from scheduler.fairness.weights import weight_of
from scheduler.jobs.models import Job, JobStatus

log = structlog.get_logger(__name__)


def fair_aging_candidates(
    session: Session, *, sources: Sequence[str], cutoff: datetime, room: int, weights: Mapping[str, float],
) -> list[Any]:
    """Up to ``room`` aged queued jobs of ``sources``, each tenant's oldest first, interleaved by
    rank / weight. Rows: id, queue, tenant, batch_id, cost, created_at, available_at, rank."""
    ranked = (
        select(Job.id, Job.queue, Job.tenant, Job.batch_id, Job.cost, Job.created_at, Job.available_at,
               func.row_number().over(partition_by=Job.tenant, order_by=(Job.available_at, Job.id))
               .label("rank"))
        .where(Job.status == JobStatus.QUEUED.value, Job.queue.in_(sources), Job.available_at <= cutoff,
               Job.cancel_requested.is_(False))
        .subquery()
    )
    rows = list(session.execute(select(ranked).where(ranked.c.rank <= room)).all())
    weight = weight_of(weights)
    rows.sort(key=lambda row: (row.rank / weight(row.tenant), row.available_at, str(row.id)))
    return rows[:room]


def forget_promoted(client: redis.Redis, rows: Iterable[Any]) -> None:
    """Drop promoted jobs from their old class's held index (their new message is aging's)."""
    jobs = [HeldJob(job_id=row.id, queue=row.queue, tenant=row.tenant, batch_id=row.batch_id, cost=row.cost,
                    order=submission_order(row.created_at)) for row in rows]
    try:
        forget(client, jobs)
    except redis.RedisError as exc:  # a stale entry is dropped by the release pass (SQL check)
        log.warning("fair_share.aging_forget_failed", jobs=len(jobs), error=type(exc).__name__)
