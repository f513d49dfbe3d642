"""This worker follows the operator's drain flags (``scheduler.fleet.queue_drain``).

The admin API's broadcast reaches running workers at once; this follower makes the flag hold
for a worker that starts while a queue is drained (the flags are read before the consumer
exists, so its drained queues are never selected) or that missed the broadcast: at every
heartbeat it reads the flags and hands them to the consumer controller
(``worker/consumers.py``), which changes the consumers if they differ. What the worker consumes
is the controller's to decide; this module only reads Redis.
"""

from __future__ import annotations

import redis
import structlog

from scheduler.fleet.queue_drain import drained_queues
from worker.consumers import ConsumerController

log = structlog.get_logger(__name__)


class DrainFollower:
    """Feeds one worker's consumer controller the drained-queue flags in Redis."""

    def __init__(self, *, redis_client: redis.Redis, controller: ConsumerController, node: str) -> None:
        self._redis = redis_client
        self._controller = controller
        self._node = node

    def read(self) -> frozenset[str] | None:
        """The drained queues now, or None when Redis cannot say (keep what is known)."""
        try:
            return frozenset(drained_queues(self._redis))
        except redis.RedisError as exc:
            log.warning("worker.drain_flags_unreadable", error=type(exc).__name__)
            return None

    def sync(self) -> None:
        """Read the flags and pass them on (the controller sends nothing when they did not change)."""
        drained = self.read()
        if drained is None:
            return
        before = self._controller.state.drained
        configured = self._controller.state.configured
        for queue in sorted((drained - before) & set(configured)):
            log.info("worker.queue_drained", queue=queue, node=self._node)
        for queue in sorted((before - drained) & set(configured)):
            log.info("worker.queue_resumed", queue=queue, node=self._node)
        self._controller.update(drained=drained)
