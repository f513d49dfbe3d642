"""The reconciler's part of canaries: pins that no longer match a serving version, and lanes.

Run by ``cloverq.reconcile`` before ``enqueue_due_jobs`` (``scheduler/maintenance/tasks.py``). It keeps
the two documented rules for a job whose version has no worker:

1. **Retired version: unpinned.** A queued job pinned to a version that is neither the active nor
   the canary one (an activation or promotion moved on while it waited, or an API process routed
   it with the state of an instant before) is unpinned: any worker takes it.
2. **Canary without a worker: re-routed to stable.** While no registered worker serves or loads the
   canary version *for the job's queue* (a canary pool may consume some class queues only, e.g.
   not ``joint``), a canary job queued longer than ``canary_reroute_seconds`` is pinned to the
   stable version instead. Jobs pinned to the stable version wait for a stable worker, as every job
   waits for a worker of its queue.

Which lane a message should be on is ``scheduler.model_versions.canary_routing.lane``: ``enqueue_due_jobs``
compares it with the queue recorded in the job's enqueued marker and republishes a job whose
message waits on a canary lane it no longer belongs to.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import redis
import structlog
from sqlalchemy import update
from sqlalchemy.orm import Session

from scheduler.fleet.workers import WorkerInfo, WorkerState, list_workers
from scheduler.infra.db import rowcount
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job, JobStatus, utcnow
from scheduler.model_versions.canary_routing import queue_of_lane
from scheduler.model_versions.registry import ActiveModel

log = structlog.get_logger(__name__)

LOADING_STATES = (WorkerState.STARTING, "switching")  # a worker on its way to a version


def serves_or_loads(worker: WorkerInfo, model: str, version: str) -> bool:
    """Whether ``worker`` serves ``model``'s ``version`` now or, being a canary worker of it, is
    loading (it will)."""
    if worker.state in (WorkerState.FAILED, WorkerState.STOPPED):
        return False
    if worker.stats.get("served_model") not in (None, model):
        return False
    if (worker.model_version or "").split("@", 1)[0] == version:
        return True
    return worker.stats.get("model_track") == "canary" and worker.state in LOADING_STATES


def canary_queues(workers: list[WorkerInfo], model: str, version: str) -> list[str]:
    """The class queues some worker serving (or loading) ``model``'s canary ``version`` consumes."""
    return sorted({queue_of_lane(queue) for worker in workers if serves_or_loads(worker, model, version)
                   for queue in worker.queues})


def heal_pins(session: Session, *, redis_client: redis.Redis, settings: Settings,
              now: datetime | None = None) -> int:
    """Apply rules 1 and 2 of the module doc for ``settings.model.served``; returns jobs moved."""
    if not settings.model.served:
        return 0
    row = session.get(ActiveModel, settings.model.served, populate_existing=True)
    if row is None:
        session.commit()
        return 0
    now = now or utcnow()
    queued = Job.status == JobStatus.QUEUED.value
    live = [v for v in (row.version, row.canary_version) if v is not None]
    retired = rowcount(session.execute(
        update(Job).where(queued, Job.routed_version.is_not(None), Job.routed_version.not_in(live))
        .values(routed_version=None, updated_at=now)
    ))
    rerouted = 0
    if row.canary_version is not None:
        covered = canary_queues(list_workers(redis_client), row.name, row.canary_version)
        waited = now - timedelta(seconds=settings.canary.reroute_seconds)
        rerouted = rowcount(session.execute(
            update(Job).where(queued, Job.routed_version == row.canary_version, Job.created_at <= waited,
                              Job.queue.not_in(covered))
            .values(routed_version=row.version, updated_at=now)
        ))
    session.commit()
    if retired or rerouted:
        log.warning("reconciler.canary_pins_moved", unpinned=retired, rerouted_to_stable=rerouted,
                    canary=row.canary_version, stable=row.version)
    return retired + rerouted


