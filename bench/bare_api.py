"""The baseline of ``bench.api``: a bare FastAPI app doing the same SQL insert + Redis push.

No validation beyond JSON parsing, no auth, no routing, no admission: one INSERT into the
same ``jobs`` table (committed) and one LPUSH of a message of Celery's size, the floor any
submit endpoint on this stack pays. ``GET`` is one primary-key SELECT. Same server (uvicorn,
one process), same sync-SQLAlchemy-in-a-threadpool model, same database and Redis as the
real API, so the ratio isolates what cloverq's API adds.

Run: ``python -m bench.bare_api --port 8101`` (settings from the environment, like the API).
"""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import anyio.to_thread
import uvicorn
from fastapi import Body, Depends, FastAPI, Request, Response
from redis import Redis
from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from scheduler.infra.db import make_engine, session_factory
from scheduler.infra.settings import get_settings
from scheduler.jobs.models import Job, JobStatus, QueueName, utcnow

BARE_QUEUE = "bench:bare:queue"
_SCALARS = (int, float, str, dict, list, type(None))


def _session(request: Request) -> Iterator[Session]:
    with request.app.state.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(_session)]


@asynccontextmanager
async def _lifespan(_: FastAPI) -> AsyncIterator[None]:
    anyio.to_thread.current_default_thread_limiter().total_tokens = 128  # as the real API
    yield


def create_bare_app() -> FastAPI:
    """The baseline app for the process settings."""
    settings = get_settings()
    app = FastAPI(lifespan=_lifespan)
    app.state.sessions = session_factory(make_engine(settings.resolved_database_url))
    redis = Redis.from_url(settings.resolved_redis_url, decode_responses=True)

    @app.post("/bare/jobs", status_code=202)
    def submit(
        body: Annotated[dict[str, Any], Body()], session: SessionDep, response: Response
    ) -> dict[str, str]:
        job_id = uuid.uuid4()
        now = utcnow()
        session.execute(insert(Job).values(
            id=job_id, tenant="bench", kind=str(body.get("kind", "generate")), status=JobStatus.QUEUED.value,
            priority=QueueName.INTERACTIVE.value, queue=QueueName.INTERACTIVE.value, cost=0,
            input=body.get("input"), params=body.get("params") or {}, steps_used=0, attempt=0, max_attempts=3,
            cancel_requested=False, created_at=now, available_at=now, updated_at=now,
        ))
        session.commit()
        message = {"id": str(job_id), "task": "cloverq.run_job", "args": [str(job_id)], "pad": "x" * 600}
        redis.lpush(BARE_QUEUE, json.dumps(message))
        response.headers["Location"] = f"/bare/jobs/{job_id}"
        return {"id": str(job_id), "status": JobStatus.QUEUED.value}

    @app.get("/bare/jobs/{job_id}")
    def read(job_id: uuid.UUID, session: SessionDep) -> dict[str, Any]:
        row = session.execute(select(Job.__table__).where(Job.id == job_id)).mappings().one_or_none()
        if row is None:
            return {"error": "not found"}
        return {key: value if isinstance(value, _SCALARS) else str(value) for key, value in row.items()}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8101)
    args = parser.parse_args()
    uvicorn.run(create_bare_app(), host="127.0.0.1", port=args.port, access_log=False, log_level="warning")


if __name__ == "__main__":
    main()
