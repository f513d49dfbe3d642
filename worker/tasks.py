"""Celery tasks of the GPU worker: thin wrappers over ``worker.runtime`` (ids in, nothing out)."""

from __future__ import annotations

from celery import Task, shared_task
from celery.exceptions import Reject

from scheduler.infra.celery_app import RUN_JOB_TASK
from scheduler.observability import tracing
from worker.job_runner import HandBackFailed
from worker.runtime import get_runtime


@shared_task(name=RUN_JOB_TASK, bind=True, ignore_result=True, acks_late=True, reject_on_worker_lost=True)
def run_job(self: Task, job_id: str) -> str:
    """Run job ``job_id`` on this process's resident model (fenced: duplicates are no-ops)."""
    queue = (self.request.delivery_info or {}).get("routing_key")
    parent = tracing.from_task_request(self.request)
    try:
        return get_runtime().run_job(job_id, queue=queue, trace_parent=parent)
    except HandBackFailed as exc:  # unclaimed, and the reconciler cannot see it: back to the broker
        raise Reject(str(exc), requeue=True) from exc

