"""FastAPI dependencies, as ``Annotated`` aliases (FastAPI full-stack-template style).

Everything a route needs comes through here from ``app.state`` (set up once by
:func:`api.app.create_app`), so routes stay free of globals and tests can build an app with
their own ``Settings``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from redis import Redis
from sqlalchemy.orm import Session

from api.auth import Caller, get_caller, get_unmetered_caller
from api.errors import ApiError
from api.prompt_tokens import PromptTokenCounter
from scheduler.settings import Settings

# The accessors are ``async`` on purpose: FastAPI runs sync dependencies in the thread pool,
# and a thread hop per trivial lookup is measurable on the submit path.


async def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def _session(request: Request) -> Iterator[Session]:
    with request.app.state.session_factory() as session:
        yield session


async def _redis(request: Request) -> Redis:
    client: Redis = request.app.state.redis
    return client


async def _token_counter(request: Request) -> PromptTokenCounter:
    counter: PromptTokenCounter = request.app.state.token_counter
    return counter


SettingsDep = Annotated[Settings, Depends(_settings)]
SessionDep = Annotated[Session, Depends(_session)]
RedisDep = Annotated[Redis, Depends(_redis)]
TokenCounterDep = Annotated[PromptTokenCounter, Depends(_token_counter)]
CallerDep = Annotated[Caller, Depends(get_caller)]
# Authenticated but not yet rate-limited: only for a route that meters itself (see api.auth).
UnmeteredCallerDep = Annotated[Caller, Depends(get_unmetered_caller)]


def require(caller: Caller, scope: str) -> None:
    """403 ``forbidden`` unless ``caller`` holds ``scope`` (``admin`` holds every scope)."""
    if not caller.has_scope(scope):
        message = f"This API key lacks the '{scope}' scope."
        raise ApiError(403, "forbidden", message, {"required_scope": scope})


def visible_tenant(caller: Caller) -> str | None:
    """The tenant whose jobs ``caller`` may see; ``None`` (all tenants) for admin keys."""
    return caller.tenant_filter
