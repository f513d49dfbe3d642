"""The beat's fair-share tick: release held jobs into free window room, the backstop.

Submits, batches and workers release as they go (``scheduler/fairness/gate.py``,
``kicker.py``); this tick covers what they could not: a release that failed or found the lock
held by a process that died, room freed by a purge of dead messages, jobs the reconciler held.
It runs every ``scheduling.fair_share_tick_seconds``. With fair share off it drops whatever index
is left (the reconciler publishes those jobs, reading their held markers as no message).
"""

from __future__ import annotations

import structlog
from celery import shared_task

from scheduler.fairness.gate import enabled, release_quietly, releaser
from scheduler.fairness.held import drop_index, held_count
from scheduler.infra.celery_app import get_celery_app
from scheduler.infra.periodic_tick import TICK_TASK_OPTIONS
from scheduler.infra.queue_names import JOB_QUEUES
from scheduler.infra.redis_client import get_redis
from scheduler.infra.settings import get_settings

log = structlog.get_logger(__name__)

RELEASE_FAIR_TASK = "cloverq.release_fair"
TICK_PASSES = 16


@shared_task(name=RELEASE_FAIR_TASK, **TICK_TASK_OPTIONS)  # a tick: see maintenance
def release_fair_task() -> int:
    settings = get_settings()
    client = get_redis(settings.resolved_redis_url)
    if not enabled(settings):
        dropped = sum(drop_index(client, queue) for queue in JOB_QUEUES if held_count(client, queue))
        if dropped:
            log.warning("fair_share.index_dropped", jobs=dropped)
        return 0
    release = releaser(settings, get_celery_app(), client)
    return sum(release_quietly(release, queue, max_passes=TICK_PASSES) for queue in JOB_QUEUES)
