"""Names of every Celery queue the job system uses, in one place (imports nothing of cloverq).

- the job queues, one per priority class (``QueueName``; also re-exported by ``scheduler.jobs.models``);
- ``maintenance`` (beat's ticks) and ``webhooks`` (webhook deliveries), consumed by the light beat
  process only (``scheduler/maintenance/beat.py``), never by a GPU worker;
- the canary lanes: ``canary.<job queue>`` (``scheduler/model_versions/canary_routing.py``).
"""

from __future__ import annotations

import enum


class QueueName(enum.StrEnum):
    """Celery queues, one per priority class; their order here is the consumption priority."""

    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BULK = "bulk"
    JOINT = "joint"

    @property
    def rank(self) -> int:
        """0 = served first. ``joint`` is separate (own workers/slot cap), ranked last."""
        return list(QueueName).index(self)


# Every job queue, in consumption order.
JOB_QUEUES: tuple[str, ...] = tuple(q.value for q in QueueName)
# Classes a client may name in ``priority`` (scheduler/jobs/routing.py); ``joint`` is chosen by mode.
PRIORITY_CLASSES: tuple[QueueName, ...] = (QueueName.INTERACTIVE, QueueName.STANDARD, QueueName.BULK)
# A worker's queues when none are configured (``Settings.worker.queues``): the non-joint classes.
DEFAULT_WORKER_QUEUES: tuple[str, ...] = tuple(q.value for q in PRIORITY_CLASSES)

MAINTENANCE_QUEUE = "maintenance"  # beat's maintenance ticks (scheduler/maintenance/tasks.py)
WEBHOOKS_QUEUE = "webhooks"  # webhook deliveries (scheduler/webhooks/tasks.py): never on a GPU worker

# Every queue the Celery app declares (canary lanes are created on first use).
ALL_QUEUES: tuple[str, ...] = (*JOB_QUEUES, MAINTENANCE_QUEUE, WEBHOOKS_QUEUE)

# Jobs routed to a canary version travel on ``canary.<queue>`` (scheduler/model_versions/canary_routing.py).
CANARY_LANE_PREFIX = "canary."
