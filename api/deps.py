"""FastAPI dependencies, as ``Annotated`` aliases (FastAPI full-stack-template style).

Everything a route needs comes through here from ``app.state`` (set up once by
:func:`api.app.create_app`), so routes stay free of globals and tests can build an app with
their own ``Settings``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Annotated

from celery import Celery
from fastapi import Depends, Request
from redis import Redis
from sqlalchemy.orm import Session, sessionmaker

from api.auth import Caller, Scope, requires
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


_celery_lock = threading.Lock()


def _celery(request: Request) -> Celery:
    """The app's Celery app (remote control), built once from its settings where the app was made
    without one (sync: that build runs in the thread pool, off the event loop)."""
    state = request.app.state
    app = getattr(state, "celery", None) or getattr(state, "admin_celery", None)
    if app is None:
        with _celery_lock:
            app = getattr(state, "admin_celery", None)
            if app is None:
                app = create_celery_app(state.settings)
                state.admin_celery = app
    celery: Celery = app
    return celery


SettingsDep = Annotated[Settings, Depends(_settings)]
SessionDep = Annotated[Session, Depends(_session)]
SessionFactoryDep = Annotated[sessionmaker[Session], Depends(_session_factory)]
CeleryDep = Annotated[Celery, Depends(_celery)]
RedisDep = Annotated[Redis, Depends(_redis)]
TokenCounterDep = Annotated[PromptTokenCounter, Depends(_token_counter)]
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
