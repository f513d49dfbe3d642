"""The worker registry in Redis: who is serving, on which queues, with which model, and whether ready.

Each worker process keeps one hash (``cloverq:worker:<id>``, refreshed by its heartbeat with a
TTL) and its id in the ``cloverq:workers`` set. A worker that dies stops refreshing; its hash
expires and readers drop it. ``/readyz`` and the admin API read this.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from scheduler import redis_keys


class WorkerState:
    STARTING = "starting"  # loading the model / warming up
    READY = "ready"  # consuming jobs
    DRAINING = "draining"  # SIGTERM received: no new jobs, running ones finish
    FAILED = "failed"  # the engine died; the process is shutting down to be restarted
    STOPPED = "stopped"


@dataclass
class WorkerInfo:
    """One worker process as published in the registry."""

    id: str
    hostname: str
    pid: int
    queues: list[str]
    state: str
    model_version: str | None = None
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def is_ready(self) -> bool:
        return self.state == WorkerState.READY


def heartbeat_ttl(interval_seconds: float) -> int:
    return max(5, int(3 * interval_seconds) + 2)


def publish_worker(client: redis.Redis, info: WorkerInfo, *, ttl_seconds: int) -> None:
    """Write the worker's hash (full snapshot) and keep it alive for ``ttl_seconds``."""
    info.heartbeat_at = time.time()
    mapping = {k: json.dumps(v) for k, v in asdict(info).items()}
    key = redis_keys.worker(info.id)
    pipe = client.pipeline(transaction=False)
    pipe.hset(key, mapping=mapping)
    pipe.expire(key, ttl_seconds)
    pipe.sadd(redis_keys.WORKERS_SET, info.id)
    pipe.execute()


def remove_worker(client: redis.Redis, worker_id: str) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.delete(redis_keys.worker(worker_id))
    pipe.srem(redis_keys.WORKERS_SET, worker_id)
    pipe.execute()


def list_workers(client: redis.Redis) -> list[WorkerInfo]:
    """Every live worker (expired entries are pruned from the set on the way)."""
    ids = sorted(client.smembers(redis_keys.WORKERS_SET))
    if not ids:
        return []
    pipe = client.pipeline(transaction=False)
    for worker_id in ids:
        pipe.hgetall(redis_keys.worker(worker_id))
    rows = pipe.execute()
    alive: list[WorkerInfo] = []
    dead: list[str] = []
    for worker_id, row in zip(ids, rows, strict=True):
        if not row:
            dead.append(worker_id)
            continue
        values = {k: json.loads(v) for k, v in row.items()}
        known = {k: values[k] for k in WorkerInfo.__dataclass_fields__ if k in values}
        alive.append(WorkerInfo(**known))
    if dead:
        client.srem(redis_keys.WORKERS_SET, *dead)
    return alive


def ready_workers(client: redis.Redis, *, queue: str | None = None) -> list[WorkerInfo]:
    """Ready workers, optionally only those consuming ``queue``."""
    return [w for w in list_workers(client) if w.is_ready and (queue is None or queue in w.queues)]
