"""Per-tenant view of each class: what fair share is sharing out (dashboard and ``/metrics``).

SQL says how many jobs each tenant has queued and running per class and how long its oldest due
job has waited (one GROUP BY); Redis adds how many of the queued ones fair share holds without a
message (``scheduler.fairness.held``) and the tenants' weights. Counts and times only, never a
payload.
"""

from __future__ import annotations

from typing import Any

import redis
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from scheduler.fairness.held import held_by_tenant
from scheduler.fairness.weights import DEFAULT_WEIGHT, read_weights
from scheduler.infra.queue_names import JOB_QUEUES
from scheduler.jobs.models import Job, JobStatus, utcnow

_ACTIVE = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)


def tenant_counts(session: Session) -> dict[tuple[str, str], dict[str, Any]]:
    """Per ``(queue, tenant)`` with active jobs: ``queued``, ``running`` and ``oldest_wait_seconds``
    (the oldest due queued job's wait; 0 when none is due)."""
    now = utcnow()
    queued = Job.status == JobStatus.QUEUED.value
    rows = session.execute(
        select(Job.queue, Job.tenant,
               func.sum(case((queued, 1), else_=0)), func.sum(case((queued, 0), else_=1)),
               func.min(case((queued & (Job.available_at <= now), Job.available_at))))
        .where(Job.status.in_(_ACTIVE)).group_by(Job.queue, Job.tenant)
    ).all()
    session.commit()
    return {(str(queue), str(tenant)): {
        "queued": int(n_queued or 0), "running": int(n_running or 0),
        "oldest_wait_seconds": max(0.0, (now - since).total_seconds()) if since is not None else 0.0,
    } for queue, tenant, n_queued, n_running, since in rows}


def tenant_rows(session: Session, redis_client: redis.Redis) -> list[dict[str, Any]]:
    """The dashboard's rows: SQL counts with fair share's held count and each tenant's weight
    (Redis down: those two left out, the counts still shown)."""
    counts = tenant_counts(session)
    try:
        held = held_by_tenant(redis_client, JOB_QUEUES)
        weights: dict[str, float] | None = read_weights(redis_client)
    except redis.RedisError:
        held, weights = {}, None
    return [{"queue": queue, "tenant": tenant, **figures, "held": held.get((queue, tenant), 0),
             "weight": None if weights is None else weights.get(tenant, DEFAULT_WEIGHT)}
            for (queue, tenant), figures in sorted(counts.items())]
