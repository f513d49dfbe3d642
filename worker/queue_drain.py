"""This worker follows the operator's drain flags (``scheduler.drain``).

The admin API's broadcast reaches running workers at once; this follower makes the flag hold
for a worker that starts while a queue is drained (its drained queues are deselected before
the consumer exists) or that missed the broadcast: at every heartbeat it compares the queues
it consumes with the flags and changes its consumers through Celery remote control addressed
to itself (handled on the consumer's own thread, so nothing here touches kombu state from
another thread).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis
import structlog
from celery import Celery

from scheduler.drain import drained_queues, queues_to_change

log = structlog.get_logger(__name__)


class DrainFollower:
    """Keep one worker's consumers in line with the drained-queue flags in Redis."""

    def __init__(
        self, *, app: Celery, redis_client: redis.Redis, node: str, configured: Sequence[str],
        lane: Callable[[str], str] | None = None,
    ) -> None:
        """``lane``: the Celery queue consumed for a class queue (a canary worker's
        ``canary.<queue>``, ``WorkerRuntime.lane_name``); drain flags stay per class queue."""
        self._app = app
        self._lane = lane or (lambda queue: queue)
        self._redis = redis_client
        self._node = node
        self._configured = list(configured)
        self._consuming = set(configured)  # what `celery worker --queues` started with
        self._lock = threading.Lock()

    def exclude_at_start(self, queues: Any) -> list[str]:
        """On ``worker_init`` (before any consumer exists): do not consume drained queues at all,
        so a worker starting while a queue is drained never takes one of its jobs.
        ``queues`` is the Celery app's ``amqp.queues``."""
        try:
            drained = drained_queues(self._redis)
        except redis.RedisError as exc:
            log.warning("worker.drain_flags_unreadable", error=type(exc).__name__)
            return []
        skipped = [queue for queue in self._configured if queue in drained]
        if skipped:
            queues.deselect(skipped)
            with self._lock:
                self._consuming.difference_update(skipped)
            log.info("worker.queues_drained_at_start", queues=skipped, node=self._node)
        return skipped

    @property
    def consuming(self) -> list[str]:
        """The configured queues this worker consumes now (priority order)."""
        return [queue for queue in self._configured if queue in self._consuming]

    def sync(self) -> None:
        """Cancel consumers of drained queues and re-add resumed ones (no-op when in line)."""
        try:
            drained = drained_queues(self._redis)
        except redis.RedisError as exc:
            log.warning("worker.drain_flags_unreadable", error=type(exc).__name__)
            return
        with self._lock:
            to_cancel, to_add = queues_to_change(
                configured=self._configured, consuming=self._consuming, drained=drained
            )
            for queue in to_cancel:
                self._app.control.cancel_consumer(self._lane(queue), destination=[self._node])
                self._consuming.discard(queue)
                log.info("worker.queue_drained", queue=queue, node=self._node)
            for queue in to_add:
                self._app.control.add_consumer(self._lane(queue), destination=[self._node])
                self._consuming.add(queue)
                log.info("worker.queue_resumed", queue=queue, node=self._node)
