"""A job the worker leaves unclaimed is never hidden: when its enqueued marker cannot be dropped
(Redis answered nothing), the message goes back to the broker instead of being acked."""

from __future__ import annotations

import uuid

import pytest
from celery.exceptions import Reject

from scheduler.infra.settings import Settings
from worker.job_runner import HandBackFailed
from worker.runtime import WorkerRuntime, set_runtime


def _draining_runtime() -> WorkerRuntime:
    # Port 1 on loopback refuses at once: every Redis call of this runtime fails.
    settings = Settings(database_url="sqlite://", redis_url="redis://127.0.0.1:1/0")
    runtime = WorkerRuntime(settings, worker_id="w-hand-back", queues=("interactive", "bulk"))
    runtime.lifecycle.draining.set()  # SIGTERM: every message is handed back unclaimed
    return runtime


def test_a_hand_back_whose_marker_stays_raises_instead_of_returning() -> None:
    with pytest.raises(HandBackFailed):
        _draining_runtime().run_job(str(uuid.uuid4()), queue="bulk")


def test_the_task_requeues_the_message_of_a_failed_hand_back() -> None:
    from worker.tasks import run_job

    set_runtime(_draining_runtime())
    try:
        with pytest.raises(Reject) as rejected:
            run_job.run(str(uuid.uuid4()))  # the task body, as the Celery worker calls it
        assert rejected.value.requeue
    finally:
        set_runtime(None)
