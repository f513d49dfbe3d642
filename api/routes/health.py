"""``/healthz`` = ``/livez`` (alive, touches nothing), ``/readyz`` (can work actually run?) and
``/readyz/replica`` (does this replica take new requests? for load balancers: not stopping).

``/readyz`` answers within ``readiness_timeout_seconds`` whatever its dependencies do: each check
runs in a worker thread and one that has not answered by the deadline counts as failed, so a
database or Redis that accepts connections and never answers gives a prompt 503 (issue 16), not a
probe that hangs until the load balancer gives up. The abandoned thread ends on its own, bounded by
the database connect timeout or the Redis socket timeout.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
from fastapi import APIRouter, Response
from redis import Redis
from sqlalchemy import text

from api.deps import DrainDep, RedisDep, SessionFactoryDep, SettingsDep
from api.drain import ApiDrain
from api.schemas.health import Health, Readiness, ReadinessCheck
from scheduler.fleet.workers import consuming_classes, ready_workers, unconsumed_classes

router = APIRouter(tags=["health"])
REPLICA_READY_PATH = "/readyz/replica"

DependencyResult = tuple[dict[str, ReadinessCheck], dict[str, int]]


@router.get("/livez", response_model=Health)
@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is alive (``/livez``, the liveness probe's name, is the same). Cheap by design:
    load balancers call it often."""
    return Health()


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(response: Response, settings: SettingsDep, session_factory: SessionFactoryDep,
                 redis_client: RedisDep, drain: DrainDep) -> Readiness:
    """Ready when the database and Redis answer, at least one worker is ready and no ready worker's
    consumer is off a queue it should consume (``consumers``), decided within the readiness
    deadline (a check still running then has failed). ``ready_workers`` counts, per queue, the
    ready workers whose Celery consumer consumes it now (read back from the consumer itself).
    A replica that is stopping (``api/drain.py``) is not ready either (``draining``)."""
    deadline: float = settings.observability.readiness_timeout_seconds
    checks: dict[str, ReadinessCheck] = {}
    per_queue: dict[str, int] = {}

    async def database() -> None:
        checks.update(await _bounded(lambda: _check_database(session_factory), deadline,
                                     _timed_out(("database",), deadline)[0]))

    async def redis() -> None:
        found, queues = await _bounded(lambda: _check_redis(redis_client), deadline,
                                       _timed_out(("redis", "workers", "consumers"), deadline))
        checks.update(found)
        per_queue.update(queues)

    async with anyio.create_task_group() as group:  # both at once: one deadline, not two
        group.start_soon(database)
        group.start_soon(redis)
    ordered = {name: checks[name] for name in ("database", "redis", "workers", "consumers")}
    if drain.draining:
        ordered["draining"] = _draining(drain)
    ready = all(check.ok for check in ordered.values())
    if not ready:
        response.status_code = 503
    return Readiness(ready=ready, checks=ordered, ready_workers=per_queue)


@router.get(REPLICA_READY_PATH, response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz_replica(response: Response, drain: DrainDep) -> Readiness:
    """Whether this replica takes new requests: it is not stopping (``api/drain.py``). For load
    balancers (HAProxy's health check, a Kubernetes readinessProbe). It reads no shared service on
    purpose: a database or Redis blip, or no ready worker (jobs queue meanwhile), would take every
    replica out at once, and each request answers for those itself (503 with ``Retry-After``)."""
    if drain.draining:
        response.status_code = 503
        response.headers["Retry-After"] = "1"
        return Readiness(ready=False, checks={"draining": _draining(drain)})
    return Readiness(ready=True, checks={"draining": ReadinessCheck(ok=True)})


def _draining(drain: ApiDrain) -> ReadinessCheck:
    return ReadinessCheck(ok=False, detail=f"stopping: listeners close in {drain.seconds_left():.1f}s")


def _timed_out(names: tuple[str, ...], deadline: float) -> DependencyResult:
    """What a check that did not answer within ``deadline`` reports for each of its ``names``."""
    failed = ReadinessCheck(ok=False, detail=f"no answer within {deadline:g}s")
    return dict.fromkeys(names, failed), {}


async def _bounded(check: Callable[[], Any], deadline: float, on_timeout: Any) -> Any:
    """``check()`` in a worker thread, or ``on_timeout`` once ``deadline`` seconds have passed.

    The thread is abandoned, not interrupted (a blocking driver call cannot be): it frees its
    thread-pool token at once and ends when the driver's own timeout fires.
    """
    with anyio.move_on_after(deadline):
        return await anyio.to_thread.run_sync(check, abandon_on_cancel=True)
    return on_timeout


def _check_database(session_factory: Callable[[], Any]) -> dict[str, ReadinessCheck]:
    """``SELECT 1`` through the app's pool (blocking)."""
    try:
        with session_factory() as session:
            session.execute(text("SELECT 1"))
        return {"database": ReadinessCheck(ok=True)}
    except Exception as exc:  # any failure means "not ready"; the detail says why
        return {"database": ReadinessCheck(ok=False, detail=type(exc).__name__)}


def _check_redis(client: Redis) -> DependencyResult:
    """Redis answers, and the ready workers per queue from the registry (blocking)."""
    try:
        client.ping()
        live_ready = ready_workers(client)
    except Exception as exc:
        unreachable = ReadinessCheck(ok=False, detail="redis unreachable")
        return {"redis": ReadinessCheck(ok=False, detail=type(exc).__name__),
                "workers": unreachable, "consumers": unreachable}, {}
    per_queue = dict(sorted(Counter(queue for w in live_ready for queue in consuming_classes(w)).items()))
    workers = ReadinessCheck(ok=len(live_ready) > 0, detail=f"{len(live_ready)} ready")
    off = {w.id: unconsumed_classes(w) for w in live_ready if unconsumed_classes(w)}
    consumers = ReadinessCheck(ok=not off, detail="; ".join(
        f"{worker} not consuming {', '.join(queues)}" for worker, queues in sorted(off.items())) or None)
    return {"redis": ReadinessCheck(ok=True), "workers": workers, "consumers": consumers}, per_queue
