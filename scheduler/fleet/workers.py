"""The worker registry in Redis: who is serving, on which queues, with which model, and whether ready.

Each worker process keeps one hash (``cloverq:worker:<id>``, refreshed by its heartbeat with a
TTL) and its id in the ``cloverq:workers`` set. A worker that dies stops refreshing; its hash
expires and readers drop it. ``/readyz`` and the admin API read this.

The TTL outlives a few heartbeats (a Redis blip must not drop a live worker from the listing),
so readiness does not wait for it: a reader measures how long ago each entry was refreshed, by
Redis's clock (the TTL left against the TTL set, so hosts' clocks never matter), and a worker
whose next heartbeat is overdue is not ready (:func:`stale_after`). A SIGKILLed worker leaves
``/readyz`` within one heartbeat, not after the TTL (issue 16).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import redis

from scheduler.infra import redis_keys
from scheduler.infra.queue_names import CANARY_LANE_PREFIX

# Hash field holding the TTL a heartbeat set (not a WorkerInfo field: only readers' age uses it).
HEARTBEAT_TTL_FIELD = "heartbeat_ttl"
# WorkerInfo fields a reader computes; never published.
_READ_SIDE_FIELDS = frozenset({"heartbeat_age"})


class WorkerState:
    STARTING = "starting"  # loading the model / warming up
    READY = "ready"  # consuming jobs
    DRAINING = "draining"  # SIGTERM received: no new jobs, running ones finish
    FAILED = "failed"  # the engine died; the process is shutting down to be restarted
    STOPPED = "stopped"


# A worker process writes its entry from several threads (the monitor's heartbeat, Celery's
# mark_ready and mark_draining, a tensor-parallel group's failure): a snapshot taken before another
# thread changed the state but written after that thread's write would put the old state back
# until the next heartbeat (a worker just ready read as "starting" by a readiness probe, seen in
# CI). Each snapshot is taken and written under this lock, so the last write is the latest state;
# stats are set under it too, so a snapshot never iterates the dict while another thread adds a key.
_WRITE_LOCK = threading.Lock()


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
    # The interval this worker promises to beat at; 0: unknown (only the TTL drops it).
    heartbeat_seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)
    # Read side: seconds since the entry was last refreshed, by Redis's clock (None: unknown).
    heartbeat_age: float | None = field(default=None, compare=False)

    def set_stats(self, **values: Any) -> None:
        """Set entries of ``stats`` (under the registry's write lock: another thread may be taking a
        heartbeat's snapshot of the dict)."""
        with _WRITE_LOCK:
            self.stats.update(values)

    def drop_stat(self, name: str) -> None:
        """Remove a ``stats`` entry if present (under the lock, as ``set_stats``)."""
        with _WRITE_LOCK:
            self.stats.pop(name, None)

    @property
    def is_fresh(self) -> bool:
        """Its last heartbeat is recent enough that the next one is not overdue."""
        if self.heartbeat_age is None or self.heartbeat_seconds <= 0:
            return True
        return self.heartbeat_age <= stale_after(self.heartbeat_seconds)

    @property
    def is_ready(self) -> bool:
        """Consuming jobs, and alive as of its last heartbeat (a dead one stops being ready)."""
        return self.state == WorkerState.READY and self.is_fresh


def heartbeat_ttl(interval_seconds: float) -> int:
    return max(5, int(3 * interval_seconds) + 2)


def stale_after(interval_seconds: float) -> float:
    """Age at which a worker beating every ``interval_seconds`` has missed a heartbeat: one
    interval, plus a grace for the monitor's tick, a Redis round trip and a busy host."""
    return interval_seconds + max(1.0, interval_seconds / 2)


def publish_worker(client: redis.Redis, info: WorkerInfo, *, ttl_seconds: int) -> None:
    """Write the worker's hash (full snapshot) and keep it alive for ``ttl_seconds``."""
    with _WRITE_LOCK:
        info.heartbeat_at = time.time()
        mapping = {k: json.dumps(v) for k, v in asdict(info).items() if k not in _READ_SIDE_FIELDS}
        mapping[HEARTBEAT_TTL_FIELD] = json.dumps(ttl_seconds)
        key = redis_keys.worker(info.id)
        pipe = client.pipeline(transaction=False)
        pipe.hset(key, mapping=mapping)  # type: ignore[arg-type]  # redis-py: str keys rejected (invariant)
        pipe.expire(key, ttl_seconds)
        pipe.sadd(redis_keys.WORKERS_SET, info.id)
        pipe.execute()


def remove_worker(client: redis.Redis, worker_id: str) -> None:
    with _WRITE_LOCK:  # after any snapshot still being written, never before it
        pipe = client.pipeline(transaction=False)
        pipe.delete(redis_keys.worker(worker_id))
        pipe.srem(redis_keys.WORKERS_SET, worker_id)
        pipe.execute()


def list_workers(client: redis.Redis) -> list[WorkerInfo]:
    """Every live worker (expired entries are pruned from the set on the way)."""
    ids = sorted(cast("set[str]", client.smembers(redis_keys.WORKERS_SET)))  # decode_responses clients
    if not ids:
        return []
    pipe = client.pipeline(transaction=False)
    for worker_id in ids:
        pipe.hgetall(redis_keys.worker(worker_id))
        pipe.pttl(redis_keys.worker(worker_id))
    replies = pipe.execute()
    alive: list[WorkerInfo] = []
    dead: list[str] = []
    for worker_id, row, pttl in zip(ids, replies[0::2], replies[1::2], strict=True):
        if not row:
            dead.append(worker_id)
            continue
        values = {k: json.loads(v) for k, v in row.items()}
        known = {k: values[k] for k in WorkerInfo.__dataclass_fields__
                 if k in values and k not in _READ_SIDE_FIELDS}
        alive.append(WorkerInfo(**known, heartbeat_age=heartbeat_age(values.get(HEARTBEAT_TTL_FIELD), pttl)))
    if dead:
        client.srem(redis_keys.WORKERS_SET, *dead)
    return alive


def heartbeat_age(ttl_seconds: Any, pttl_ms: Any) -> float | None:
    """Seconds since a heartbeat set ``ttl_seconds`` on a key that has ``pttl_ms`` left (Redis's
    clock on both sides); None when either is unknown (an entry from an older worker, no TTL)."""
    if not isinstance(ttl_seconds, (int, float)) or not isinstance(pttl_ms, int) or pttl_ms < 0:
        return None
    return max(0.0, float(ttl_seconds) - pttl_ms / 1000)


def consuming_classes(worker: WorkerInfo) -> list[str]:
    """The class queues the worker's Celery consumer consumes, as the consumer itself said at its
    last read-back (a canary lane ``canary.<q>`` counts as ``<q>``); a worker that publishes no
    read-back (older versions) counts its configured queues."""
    consuming = worker.stats.get("consuming")
    if not isinstance(consuming, list):
        return list(worker.queues)
    return sorted({str(name).removeprefix(CANARY_LANE_PREFIX) for name in consuming})


def unconsumed_classes(worker: WorkerInfo) -> list[str]:
    """Class queues the worker should consume by its own state (not drained, no gate full, not
    switching) but its consumer does not: a fault, healed at its next heartbeat if it can be."""
    missing = worker.stats.get("unconsumed")
    if not isinstance(missing, list):
        return []
    return sorted({str(name).removeprefix(CANARY_LANE_PREFIX) for name in missing})


def ready_workers(client: redis.Redis, *, queue: str | None = None) -> list[WorkerInfo]:
    """Ready workers, optionally only those whose consumer consumes ``queue`` now."""
    return [w for w in list_workers(client)
            if w.is_ready and (queue is None or queue in consuming_classes(w))]
