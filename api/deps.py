"""FastAPI dependencies, as ``Annotated`` aliases (FastAPI full-stack-template style).

Everything a route needs comes through here from ``app.state`` (set up once by
:func:`api.app.create_app`), so routes stay free of globals and tests can build an app with
their own ``Settings``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Annotated, Any

import anyio
from celery import Celery
from fastapi import Depends, Request
from redis import Redis
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from api.auth import Caller, Scope, requires
from api.drain import ApiDrain
from api.job_follow import JobReader, stream_redis
from api.prompt_tokens import PromptTokenCounter
from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.settings import Settings

# The accessors are ``async`` on purpose: FastAPI runs sync dependencies in the thread pool,
# and a thread hop per trivial lookup is measurable on the submit path.


async def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def _session(request: Request) -> Iterator[Session]:
    with request.app.state.session_factory() as session:
        yield session


async def _session_factory(request: Request) -> sessionmaker[Session]:
    """The app's session factory itself, for work that outlives the request's session (a streamed
    body, a background task) or opens sessions of its own in a worker thread."""
    factory: sessionmaker[Session] = request.app.state.session_factory
    return factory


async def _redis(request: Request) -> Redis:
    client: Redis = request.app.state.redis
    return client


async def _token_counter(request: Request) -> PromptTokenCounter:
    counter: PromptTokenCounter = request.app.state.token_counter
    return counter


async def _drain(request: Request) -> ApiDrain:
    """This replica's drain (``api/drain.py``): begun when the process is told to stop."""
    drain: ApiDrain = request.app.state.drain
    return drain


async def _batch_uploads(request: Request) -> anyio.Semaphore:
    """The slots of batch bodies this process parses at once (``batch_max_concurrent_uploads``)."""
    slots: anyio.Semaphore = request.app.state.batch_uploads
    return slots


async def _job_reader(request: Request) -> JobReader:
    """How routes read one job and wait for it (``api/job_follow.py``)."""
    app = request.app
    state = app.state
    return JobReader(sessions=state.session_factory, redis=state.redis, waiter=state.job_waiter,
                     drain=state.drain, settings=state.settings, streams=lambda: stream_redis(app))


_celery_lock = threading.Lock()


async def _celery(request: Request) -> Celery:
    """The app's Celery app (publish, remote control), built once from its settings where the app
    was made without one (that build runs in the thread pool, off the event loop)."""
    state = request.app.state
    app = getattr(state, "celery", None) or getattr(state, "admin_celery", None)
    if app is None:
        app = await run_in_threadpool(_build_celery, state)
    celery: Celery = app
    return celery


def _build_celery(state: Any) -> Celery:
    with _celery_lock:
        app = getattr(state, "admin_celery", None)
        if app is None:
            app = create_celery_app(state.settings)
            state.admin_celery = app
    return app


SettingsDep = Annotated[Settings, Depends(_settings)]
SessionDep = Annotated[Session, Depends(_session)]
SessionFactoryDep = Annotated[sessionmaker[Session], Depends(_session_factory)]
CeleryDep = Annotated[Celery, Depends(_celery)]
RedisDep = Annotated[Redis, Depends(_redis)]
TokenCounterDep = Annotated[PromptTokenCounter, Depends(_token_counter)]
DrainDep = Annotated[ApiDrain, Depends(_drain)]
BatchUploadsDep = Annotated[anyio.Semaphore, Depends(_batch_uploads)]
JobReaderDep = Annotated[JobReader, Depends(_job_reader)]
# The caller of an authenticated route, with the privilege it needs (api.auth ``requires``):
# authenticated (401), rate-limited per key (401 revoked / 429), holding the scope (403).
ReadCaller = Annotated[Caller, Depends(requires(Scope.READ))]
SubmitCaller = Annotated[Caller, Depends(requires(Scope.SUBMIT))]
AdminCaller = Annotated[Caller, Depends(requires(Scope.ADMIN))]
# The tenant's webhook signing secret: whoever holds it can forge deliveries to every receiver.
WebhooksCaller = Annotated[Caller, Depends(requires(Scope.WEBHOOKS))]
# The submit hot path (POST /v1/jobs, the OpenAI completions): ``submit``, its rate-limit token
# taken in the admission round trip, and taken by the dependency itself if the route did not.
AdmittedSubmitCaller = Annotated[
    Caller, Depends(requires(Scope.SUBMIT, token_at_admission=True), scope="function")
]


def visible_tenant(caller: Caller) -> str | None:
    """The tenant whose jobs ``caller`` may see; ``None`` (all tenants) for admin keys."""
    return caller.tenant_filter
