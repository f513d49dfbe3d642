"""Drain and resume a queue: workers stop (or start again) consuming it.

Two mechanisms, so a drain holds even for workers that start later or miss a broadcast:

1. The durable flag: the Redis set ``redis_keys.DRAINED_SET`` names drained queues. A worker
   reads it (``worker/queue_drain.py`` ``DrainFollower``, through :func:`drained_queues`) before
   its consumer starts and again at every heartbeat, and hands it to its consumer controller
   (``worker/consumers.py``): ``consumed_queues`` leaves drained queues out (and their canary
   lanes, ``canary.<queue>``), so a restart never silently resumes a drained queue.
2. The fast path: a Celery remote-control command (``cancel_consumer`` / ``add_consumer``)
   reaches every running worker at once. Both are addressed (``destination``) to registered
   workers only (from the worker registry), never to every Celery node: beat is a node too (it
   consumes ``webhooks``) and neither takes nor answers for a job queue's drain.
   ``add_consumer`` goes only to workers whose *configured* queues include the queue, so resuming
   never makes a GPU worker of another pool pick up work it was not deployed for. The broadcast
   names the plain queue and knows nothing of a worker's own state (a model switch, a full gate,
   the canary lane): when the worker next reads the flag and sees it changed, its controller
   sets both the queue and its canary lane to what its state wants, so a broadcast that
   disagrees with that state (or a canary worker's lane that a drain broadcast missed) is
   corrected within one heartbeat.

Which queues a worker consumes is decided in one place, ``worker/consumers.py``
``consumed_queues``, with the drain flags as one of its inputs.

The flag's record is SQL (``scheduler.operator_state``: the admin API commits the drain there
before calling :func:`drain_queue`, and beat restores ``DRAINED_SET`` from it after a Redis
restart); the functions here are the Redis side only.

Draining does not refuse submissions: jobs keep queueing (up to the queue-depth cap) and run
when the queue is resumed. Running jobs are not touched.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis
from celery import Celery

from scheduler.redis_keys import DRAINED_SET


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def drained_queues(client: redis.Redis) -> set[str]:
    """The queues an operator has drained."""
    return {_text(name) for name in client.smembers(DRAINED_SET)}


def _nodes(replies: list[dict[str, Any]] | None, destinations: Iterable[str]) -> list[str]:
    """The nodes among ``destinations`` that answered: a reply from any other node (beat, which is a
    Celery worker node too for the ``webhooks`` queue) is never counted as a GPU worker's."""
    wanted = set(destinations)
    return sorted({node for reply in replies or [] for node in reply if node in wanted})


def drain_queue(
    client: redis.Redis, app: Celery, queue: str, *, destinations: Iterable[str], timeout: float = 1.0
) -> list[str]:
    """Flag ``queue`` drained and tell ``destinations`` (the registered workers' Celery node names)
    to stop consuming it; returns the nodes that answered (a worker that does not answer picks the
    flag up at its next heartbeat).

    The broadcast is addressed, never sent to every node: other Celery nodes (beat consumes the
    ``webhooks`` and maintenance queues) must not be touched by a drain of a job queue, and their
    replies must not stand in for a worker's. ``limit`` lets it return as soon as all of
    ``destinations`` answered instead of always waiting ``timeout``; with none there is nobody to
    tell.
    """
    client.sadd(DRAINED_SET, queue)
    nodes = sorted(set(destinations))
    if not nodes:
        return []
    return _nodes(
        app.control.cancel_consumer(queue, destination=nodes, reply=True, timeout=timeout, limit=len(nodes)),
        nodes,
    )


def resume_queue(
    client: redis.Redis, app: Celery, queue: str, *, destinations: Iterable[str], timeout: float = 1.0
) -> list[str]:
    """Clear the drain flag and tell ``destinations`` (Celery node names) to consume again."""
    client.srem(DRAINED_SET, queue)
    nodes = sorted(set(destinations))
    if not nodes:
        return []
    return _nodes(
        app.control.add_consumer(queue, destination=nodes, reply=True, timeout=timeout, limit=len(nodes)),
        nodes,
    )
