"""Drain and resume a queue: workers stop (or start again) consuming it.

Two mechanisms, so a drain holds even for workers that start later or miss a broadcast:

1. The durable flag: the Redis set ``redis_keys.DRAINED_SET`` names drained queues. A worker
   reads it (``worker/queue_drain.py`` ``DrainFollower``, through :func:`drained_queues`) before
   its consumer starts and again at every heartbeat, and hands it to its consumer controller
   (``worker/consumers.py``): ``consumed_queues`` leaves drained queues out (and their canary
   lanes, ``canary.<queue>``), so a restart never silently resumes a drained queue.
2. The fast path: one Celery remote-control command of cloverq's own, ``SYNC_DRAINS_COMMAND``,
   asks every running worker to read the flags now instead of at its next heartbeat. It names no
   queue and changes no consumer: each worker's controller decides from the flags and its own
   state (configured queues, a model switch, a full gate, the canary lane) and switches its
   consumer in process (``worker/consumers.py``), so there is exactly one mechanism that changes
   what a worker consumes. (Broadcasting Celery's ``cancel_consumer``/``add_consumer`` instead
   raced with the worker's own changes: Celery runs such commands in no fixed order, issue 31.)
   It is addressed (``destination``) to registered workers only, never to every Celery node:
   beat is a node too (it consumes ``webhooks``) and neither takes nor answers for a drain.

Which queues a worker consumes is decided in one place, ``worker/consumers.py``
``consumed_queues``, with the drain flags as one of its inputs.

The flag's record is SQL (``scheduler.fleet.operator_state`` ``set_queue_drained``, the one way a
queue is drained or resumed: it commits the change there before calling :func:`set_drained_flag`,
and beat restores ``DRAINED_SET`` from it after a Redis restart); the functions here are the Redis
side only. (Not the API replica's own drain on SIGTERM, ``api/drain.py``: that one stops a
replica, this one a queue.)

Draining does not refuse submissions: jobs keep queueing (up to the queue-depth cap) and run
when the queue is resumed. Running jobs are not touched.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis
from celery import Celery

from scheduler.infra.redis_keys import DRAINED_SET

# The remote-control command that makes a worker read the drain flags now (worker/control_commands.py).
SYNC_DRAINS_COMMAND = "cloverq_sync_drains"


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


def tell_workers(app: Celery, *, destinations: Iterable[str], timeout: float = 1.0) -> list[str]:
    """Ask ``destinations`` (the registered workers' Celery node names) to read the drain flags
    now (``SYNC_DRAINS_COMMAND``); returns the nodes that answered. A worker that does not answer
    reads them at its next heartbeat. ``limit`` lets it return as soon as every destination
    answered instead of always waiting ``timeout``; with none there is nobody to tell."""
    nodes = sorted(set(destinations))
    if not nodes:
        return []
    replies = app.control.broadcast(SYNC_DRAINS_COMMAND, destination=nodes, reply=True, timeout=timeout,
                                    limit=len(nodes))
    return _nodes(replies, nodes)


def set_drained_flag(
    client: redis.Redis, app: Celery, queue: str, *, drained: bool, destinations: Iterable[str],
    timeout: float = 1.0,
) -> list[str]:
    """Set (``drained``) or clear ``queue``'s drain flag and tell ``destinations`` at once; returns
    the nodes that answered."""
    if drained:
        client.sadd(DRAINED_SET, queue)
    else:
        client.srem(DRAINED_SET, queue)
    return tell_workers(app, destinations=destinations, timeout=timeout)
