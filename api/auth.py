"""Who is calling: API-key authentication, scopes, and the per-key rate limit.

``get_caller`` is the FastAPI dependency every ``/v1`` route depends on (through
``api.deps.CallerDep``). It reads ``Authorization: Bearer <key>``, authenticates the key
(``scheduler.keys``: lookup by id, constant-time compare of a sha256 digest; cached per
process), then takes one token from the key's rate-limit bucket (``scheduler.admission``; the
same Redis round trip also reports a revocation). ``POST /v1/jobs``, the hot path, uses
``get_unmetered_caller`` instead and takes its token in the Redis round trip of its admission
check (one round trip and one thread-pool hop fewer per submit). With ``CLOVERQ_AUTH=disabled``
every request is a development caller of tenant ``default`` with all scopes (and no rate
limit: there is no key to meter).

Errors use the API's JSON error shape (``api.errors`` renders an ``HTTPException`` whose detail
carries ``code``): 401 ``unauthorized`` (no, malformed, unknown or revoked key), 403
``forbidden`` (missing scope), 429 ``rate_limited`` with ``Retry-After``.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

import redis
import structlog
from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import sessionmaker
from starlette.concurrency import run_in_threadpool

from scheduler.admission import Admission, RateDecision
from scheduler.db import DatabaseTimeouts, make_engine
from scheduler.keys import ALL_SCOPES, SCOPE_ADMIN, KeyAuthenticator, NotCached, parse_key
from scheduler.settings import Settings, get_settings

log = structlog.get_logger(__name__)

# Documents the scheme in OpenAPI (the lock icon in /docs); we do the checking ourselves so
# that every failure has our error shape.
_bearer_scheme = HTTPBearer(auto_error=False, description="An API key from `cloverq keys create`.")


@dataclass(frozen=True, slots=True)
class Caller:
    """The authenticated principal of one request."""

    tenant: str
    scopes: frozenset[str]
    key_id: str | None

    @property
    def is_admin(self) -> bool:
        """Admin callers see every tenant's data and may use every scope."""
        return SCOPE_ADMIN in self.scopes

    @property
    def tenant_filter(self) -> str | None:
        """The tenant to scope data queries to: None (all tenants) for admin callers."""
        return None if self.is_admin else self.tenant

    def has_scope(self, scope: str) -> bool:
        """Whether the caller holds ``scope`` (the admin scope implies every other)."""
        return scope in self.scopes or self.is_admin


DEV_CALLER = Caller(tenant="default", scopes=ALL_SCOPES, key_id=None)


class Security:
    """The per-app security objects: key authenticator and admission (rate limits)."""

    def __init__(self, settings: Settings, *, session_factory: Callable[[], Any] | None = None,
                 redis_client: redis.Redis | None = None) -> None:
        if session_factory is None:
            timeouts = DatabaseTimeouts.from_settings(settings)
            session_factory = sessionmaker(make_engine(settings.resolved_database_url, timeouts=timeouts))
        if redis_client is None:
            redis_client = redis.Redis.from_url(settings.resolved_redis_url, socket_timeout=2.0,
                                                socket_connect_timeout=1.0)
        self.settings = settings
        self.session_factory = session_factory
        self.redis = redis_client
        self.authenticator = KeyAuthenticator(session_factory, cache_seconds=settings.auth_cache_seconds)
        self.admission = Admission(redis_client, settings)


_security_lock = threading.Lock()


def install_security(app: Any, settings: Settings, **kwargs: Any) -> Security:
    """Create the app's :class:`Security` now (``create_app`` may call this; else it is lazy)."""
    security = Security(settings, **kwargs)
    app.state.security = security
    return security


def security_of(request: Request) -> Security:
    """The app's :class:`Security`, built on first use from the app's settings."""
    state = request.app.state
    security = getattr(state, "security", None)
    if security is None:
        with _security_lock:
            security = getattr(state, "security", None)
            if security is None:
                security = install_security(request.app, _settings_of(request))
    return security


def _settings_of(request: Request) -> Settings:
    settings = getattr(request.app.state, "settings", None)
    return settings if isinstance(settings, Settings) else get_settings()


def _error(status_code: int, code: str, message: str, headers: dict[str, str] | None = None,
           details: Any = None) -> HTTPException:
    return HTTPException(status_code, detail={"code": code, "message": message, "details": details},
                         headers=headers)


def _unauthorized(message: str) -> HTTPException:
    return _error(401, "unauthorized", message, {"WWW-Authenticate": "Bearer"})


async def get_caller(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer_scheme)],
) -> Caller:
    """Authenticate the request and meter it against its key's rate limit."""
    caller = await _authenticate(request, credentials)
    if caller.key_id is not None:
        await run_in_threadpool(meter_caller, request, caller)
    return caller


def meter_caller(request: Request, caller: Caller) -> None:
    """Take one token from the caller's rate-limit bucket (one Redis round trip, which also
    reports a revocation): 401 revoked / 429 empty. Fails open without Redis: the rate limit
    protects capacity, and a submit needs Redis anyway. Blocking: call it off the event loop."""
    if caller.key_id is None:
        return
    request.state.rate_metered = True
    try:
        decision = security_of(request).admission.check_rate(caller.key_id, key_id=caller.key_id)
    except redis.RedisError as exc:
        log.warning("rate_limit_unavailable", error=type(exc).__name__, key_id=caller.key_id)
        return
    enforce_rate(request, caller, decision)


async def get_unmetered_caller(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer_scheme)],
) -> Caller:
    """Authenticate only: for a route that takes the rate-limit token itself, in a Redis round
    trip it makes anyway (``POST /v1/jobs``: ``Admission.admit_job``), and then MUST pass the
    decision to :func:`enforce_rate`."""
    return await _authenticate(request, credentials)


async def _authenticate(request: Request, credentials: HTTPAuthorizationCredentials | None) -> Caller:
    """The request's caller, or 401. The key cache answers without I/O on the common path, so
    only a cache miss costs a thread-pool hop (for the database lookup)."""
    settings = _settings_of(request)
    if settings.auth == "disabled":
        request.state.caller = DEV_CALLER
        return DEV_CALLER
    if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
        log.info("auth.refused", reason="missing_key", path=request.url.path)
        raise _unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
    key = credentials.credentials.strip()
    authenticator = security_of(request).authenticator
    cached = authenticator.authenticate_cached(key)
    info = (await run_in_threadpool(authenticator.authenticate, key)
            if isinstance(cached, NotCached) else cached)
    if info is None:
        # The key id (not secret) helps an operator spot a revoked key still in use; a string
        # that is not even key-shaped is not echoed at all.
        parsed = parse_key(key)
        log.warning("auth.refused", reason="invalid_key", key_id=parsed[0] if parsed else None,
                    path=request.url.path)
        raise _unauthorized("Invalid or revoked API key.")
    caller = Caller(tenant=info.tenant, scopes=info.scopes, key_id=info.key_id)
    request.state.caller = caller
    return caller


async def meter_refused_request(request: Request) -> HTTPException | None:
    """Spend a rate-limit token for a request refused before its route could (issue 16: bodies
    that fail validation were never rate-limited, so a client could send them without end).

    Called by the validation error handler. The caller is the one the route's dependency
    authenticated, or, when the body was refused before any dependency ran (JSON that does not
    parse), the key in the request's header. Returns the 401/429 to answer instead of the 422, or
    None (already metered, no key, an invalid key: the 422 stands).
    """
    if getattr(request.state, "rate_metered", False):
        return None
    caller = getattr(request.state, "caller", None)
    if caller is None:
        try:
            caller = await _authenticate(request, await _bearer_scheme(request))
        except HTTPException:
            return None
    if not isinstance(caller, Caller) or caller.key_id is None:
        return None
    try:
        await run_in_threadpool(meter_caller, request, caller)
    except HTTPException as refused:
        return refused
    return None


def enforce_rate(request: Request, caller: Caller, decision: RateDecision | None) -> None:
    """Raise 401 for a key the rate script reports revoked, 429 for an empty bucket.

    ``decision`` None: the rate limit could not be checked (Redis unavailable): fail open.
    """
    request.state.rate_metered = True
    if decision is None or caller.key_id is None:
        return
    if decision.revoked:
        security_of(request).authenticator.forget(caller.key_id)
        log.warning("auth.refused", reason="revoked_key", key_id=caller.key_id, path=request.url.path)
        raise _unauthorized("Invalid or revoked API key.")
    if not decision.allowed:
        raise _error(429, "rate_limited", "Too many requests for this API key; slow down.",
                     {"Retry-After": str(decision.retry_after_seconds)},
                     {"retry_after_seconds": decision.retry_after_seconds})


def require_scope(scope: str) -> Callable[..., Awaitable[Caller]]:
    """A dependency that passes the caller through if it holds ``scope``, else 403."""

    async def dependency(caller: Annotated[Caller, Depends(get_caller)]) -> Caller:  # no I/O: no hop
        if not caller.has_scope(scope):
            log.warning("auth.forbidden", key_id=caller.key_id, tenant=caller.tenant, required_scope=scope)
            raise _error(403, "forbidden", f"This API key lacks the '{scope}' scope.",
                         details={"required_scope": scope})
        return caller

    dependency.__name__ = f"require_{scope}_scope"
    return dependency
