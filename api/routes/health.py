"""``/healthz`` (alive, touches nothing) and ``/readyz`` (can work actually run?)."""

from __future__ import annotations

from collections import Counter

from fastapi import APIRouter, Response
from sqlalchemy import text

from api.deps import RedisDep, SessionDep
from api.schemas.health import Health, Readiness, ReadinessCheck
from scheduler.workers import ready_workers

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is alive. Cheap by design: load balancers call it often."""
    return Health()


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
def readyz(session: SessionDep, redis: RedisDep, response: Response) -> Readiness:
    """Ready when the database and Redis answer and at least one worker is ready."""
    checks: dict[str, ReadinessCheck] = {}
    per_queue: dict[str, int] = {}
    try:
        session.execute(text("SELECT 1"))
        checks["database"] = ReadinessCheck(ok=True)
    except Exception as exc:  # any failure means "not ready"; the detail says why
        checks["database"] = ReadinessCheck(ok=False, detail=type(exc).__name__)
    try:
        redis.ping()
        checks["redis"] = ReadinessCheck(ok=True)
        live_ready = ready_workers(redis)
        per_queue = dict(sorted(Counter(queue for w in live_ready for queue in w.queues).items()))
        checks["workers"] = ReadinessCheck(ok=len(live_ready) > 0, detail=f"{len(live_ready)} ready")
    except Exception as exc:
        checks["redis"] = ReadinessCheck(ok=False, detail=type(exc).__name__)
        checks["workers"] = ReadinessCheck(ok=False, detail="redis unreachable")
    ready = all(check.ok for check in checks.values())
    if not ready:
        response.status_code = 503
    return Readiness(ready=ready, checks=checks, ready_workers=per_queue)
