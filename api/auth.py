"""Who is calling: API-key authentication, scopes, and the per-key rate limit, in ONE pattern.

Every authenticated route states the privilege it needs in its signature, through a
dependency made by :func:`requires` (aliases in ``api.deps``: ``ReadCaller``, ``SubmitCaller``,
``AdminCaller``, ``AdmittedSubmitCaller``)::

    @router.get("/{job_id}")
    def get_job(job_id: str, caller: ReadCaller) -> JobOut: ...

The dependency reads ``Authorization: Bearer <key>``, authenticates the key
(``scheduler.access.key_authenticator``: lookup by id, constant-time compare of a sha256 digest;
cached per process), takes one token from the key's rate-limit bucket
(``scheduler.access.admission``; the same Redis round trip also reports a revocation) and checks
the scope (``admin`` holds every scope).
No route body checks a scope or meters itself.

The submit hot path (``POST /v1/jobs`` and the OpenAI completions, which submit the same way)
uses ``requires(scope, token_at_admission=True)`` (``AdmittedSubmitCaller``): its token rides in
the Redis round trip of the admission check (``api.admission.admit_submission``: one round trip
and one thread-pool hop fewer per submit). That variant cannot be misused: it is a dependency
with ``yield`` that checks, when the route is done, that the request's token was taken, and
takes it itself when not: with the route's error when the route failed (so a refused request
spends its token too, and a 401 / 429 wins over the route's error), quietly after a success.
The request's :class:`RequestAdmission` records every call that takes the token, so none is
ever taken twice. With ``CLOVERQ_AUTH=disabled`` every request is a development caller of
tenant ``default`` with all scopes (and no rate limit: there is no key to meter).

Failures are :class:`api.errors.ApiError` (the API's JSON error shape, stable ``code``): 401
``unauthorized`` (no, malformed, unknown, revoked or expired key: a rotated key past its overlap),
403 ``network_not_allowed`` (the caller's address is outside the key's ``allowed_networks``; no
token is taken, so a leaked key used from elsewhere cannot drain its owner's bucket), 403
``forbidden`` (missing scope), 429 ``rate_limited`` with ``Retry-After``. The order is 401, then
the network 403, then 429, then the scope 403. Each accepted request notes the key's last use
(time and address) in memory; the authenticator writes it in the background, at most once a
minute per process.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

import redis
import structlog
from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import sessionmaker
from starlette.concurrency import run_in_threadpool

from api.client_address import request_client_address
from api.errors import ApiError
from api.planes import NETWORK_NOT_ALLOWED, plane_of_path
from scheduler.access import api_keys
from scheduler.access.admission import Admission, RateDecision
from scheduler.access.api_keys import ALL_SCOPES, SCOPE_ADMIN, KeyInfo
from scheduler.access.key_authenticator import KeyAuthenticator, KeyRefusal, NotCached
from scheduler.access.key_format import parse_key
from scheduler.access.networks import allowed
from scheduler.infra.db import DatabaseTimeouts, make_engine
from scheduler.infra.redis_client import get_redis
from scheduler.infra.settings import Settings, get_settings
from scheduler.observability.audit import audit
from scheduler.observability.process_metrics import record_network_refusal

log = structlog.get_logger(__name__)

# Documents the scheme in OpenAPI (the lock icon in /docs); we do the checking ourselves so
# that every failure has our error shape.
_bearer_scheme = HTTPBearer(auto_error=False, description="An API key from `cloverq keys create`.")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer_scheme)]


class Scope(StrEnum):
    """The privileges a key may hold (``scheduler.access.api_keys``); ``admin`` implies the others."""

    SUBMIT = api_keys.SCOPE_SUBMIT
    READ = api_keys.SCOPE_READ
    WEBHOOKS = api_keys.SCOPE_WEBHOOKS
    ADMIN = api_keys.SCOPE_ADMIN


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
    """The per-app security objects: key authenticator and admission (rate limits).

    Admission runs on the process' shared Redis client (``scheduler.infra.redis_client.get_redis``:
    one pool per URL, short timeouts, so a hanging Redis fails a request's rate-limit check in
    seconds instead of hanging it)."""

    def __init__(self, settings: Settings, *, session_factory: Callable[[], Any] | None = None,
                 redis_client: redis.Redis | None = None) -> None:
        if session_factory is None:
            timeouts = DatabaseTimeouts.from_settings(settings)
            session_factory = sessionmaker(make_engine(settings.resolved_database_url, timeouts=timeouts))
        if redis_client is None:
            redis_client = get_redis(settings.resolved_redis_url)
        self.settings = settings
        self.session_factory = session_factory
        self.redis = redis_client
        self.authenticator = KeyAuthenticator(session_factory,
                                              cache_seconds=settings.security.auth_cache_seconds)
        self.admission = Admission(redis_client, settings)


class RequestAdmission:
    """The app's :class:`Admission` as one request uses it.

    The calls that take the request's rate-limit token (``check_rate``; ``admit_job``, whose
    script takes the token before anything else, whatever it answers) record that on the
    request before they run, whoever makes them, so the guarantee of
    ``requires(..., token_at_admission=True)`` never takes a second token. Everything else is
    the shared object's."""

    def __init__(self, shared: Admission, request: Request) -> None:
        self._shared = shared
        self._request = request

    def check_rate(self, bucket: str, *, key_id: str | None, cost: int = 1) -> RateDecision:
        _note_token_taken(self._request)
        return self._shared.check_rate(bucket, key_id=key_id, cost=cost)

    def admit_job(self, **kwargs: Any) -> tuple[RateDecision, bool]:
        _note_token_taken(self._request)
        return self._shared.admit_job(**kwargs)

    def __getattr__(self, name: str) -> Any:  # check_batch, release, tenant_cap, ...
        return getattr(self._shared, name)


@dataclass(frozen=True, slots=True)
class RequestSecurity:
    """:class:`Security` as one request uses it (:func:`security_of`)."""

    authenticator: KeyAuthenticator
    admission: RequestAdmission
    shared: Security


_security_lock = threading.Lock()


def install_security(app: Any, settings: Settings, **kwargs: Any) -> Security:
    """Create the app's :class:`Security` now (``create_app`` calls this; else it is lazy)."""
    security = Security(settings, **kwargs)
    app.state.security = security
    return security


def _app_security(request: Request) -> Security:
    state = request.app.state
    security = getattr(state, "security", None)
    if security is None:
        with _security_lock:
            security = getattr(state, "security", None)
            if security is None:
                security = install_security(request.app, _settings_of(request))
    return security


def security_of(request: Request) -> RequestSecurity:
    """The app's :class:`Security` (built on first use from the app's settings), for ``request``."""
    shared = _app_security(request)
    return RequestSecurity(shared.authenticator, RequestAdmission(shared.admission, request), shared)


def _settings_of(request: Request) -> Settings:
    settings = getattr(request.app.state, "settings", None)
    return settings if isinstance(settings, Settings) else get_settings()


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, None, {"WWW-Authenticate": "Bearer"})


def _forbidden(caller: Caller, scope: Scope) -> ApiError:
    log.warning("auth.forbidden", key_id=caller.key_id, tenant=caller.tenant, required_scope=str(scope))
    return ApiError(403, "forbidden", f"This API key lacks the '{scope}' scope.",
                    {"required_scope": str(scope)})


# --- the one way routes authenticate ---------------------------------------------------------------


def requires(scope: Scope, *, token_at_admission: bool = False) -> Callable[..., Any]:
    """The dependency of a route that needs ``scope``: the authenticated, rate-limited caller.

    ``token_at_admission``: the rate-limit token is taken in the route's admission round trip
    (the submit path: ``api.admission.admit_submission``); the dependency makes sure it was
    (see the module docstring). Use it through ``api.deps.AdmittedSubmitCaller``, which also
    sets ``scope="function"`` (the check runs before the response is sent).
    """
    if token_at_admission:
        return _admitted_dependency(scope)

    async def dependency(request: Request, credentials: Credentials) -> Caller:  # no hop unless metered
        caller = await _authenticate(request, credentials)
        await _take_token(request, caller)  # 401 revoked / 429 before the 403
        if not caller.has_scope(scope):
            raise _forbidden(caller, scope)
        return caller

    dependency.__name__ = f"requires_{scope}"
    return dependency


def _admitted_dependency(scope: Scope) -> Callable[..., AsyncIterator[Caller]]:
    async def dependency(request: Request, credentials: Credentials) -> AsyncIterator[Caller]:
        caller = await _authenticate(request, credentials)
        if not caller.has_scope(scope):
            await _take_token(request, caller)  # a refused request spends its token too; 401/429 win
            raise _forbidden(caller, scope)
        try:
            yield caller
        except Exception:
            if not token_taken(request):
                await _take_token(request, caller)  # refused before its admission: 401/429 win
            raise
        if not token_taken(request) and caller.key_id is not None:
            # The route never reached its admission: take the token now. The answer stands
            # (the request's work is done), so a refusal is only logged.
            log.warning("auth.token_after_route", key_id=caller.key_id, path=request.url.path)
            try:
                await _take_token(request, caller)
            except ApiError as refused:
                log.info("auth.refused_after_route", code=refused.code, key_id=caller.key_id)

    dependency.__name__ = f"requires_{scope}_token_at_admission"
    return dependency


def token_taken(request: Request) -> bool:
    """Whether this request's rate-limit token was taken (or its taking was attempted: without
    Redis the limit fails open). ``api.admission.admit_submission(metered=...)`` is told this."""
    return bool(getattr(request.state, "rate_metered", False))


def _note_token_taken(request: Request) -> None:
    request.state.rate_metered = True


async def _take_token(request: Request, caller: Caller) -> None:
    if caller.key_id is not None and not token_taken(request):
        await run_in_threadpool(meter_caller, request, caller)


async def _authenticate(request: Request, credentials: HTTPAuthorizationCredentials | None) -> Caller:
    """The request's caller, or 401. The key cache answers without I/O on the common path, so
    only a cache miss costs a thread-pool hop (for the database lookup)."""
    settings = _settings_of(request)
    if settings.security.auth == "disabled":
        request.state.caller = DEV_CALLER
        return DEV_CALLER
    if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
        log.info("auth.refused", reason="missing_key", path=request.url.path)
        given = request.headers.get("authorization", "").strip()
        if given and not given.lower().startswith("bearer"):  # e.g. Basic, or a bare key: sent another way
            scheme = given.split(" ", 1)[0]
            named = f"the {scheme!r} scheme" if " " in given and scheme.isalpha() and len(scheme) <= 12 \
                else "no scheme"  # a bare key is never echoed
            raise _unauthorized(f"The Authorization header uses {named}; send the API key as "
                                "'Authorization: Bearer <key>'.")  # fmt: skip
        raise _unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
    key = credentials.credentials.strip()
    authenticator = _app_security(request).authenticator
    cached = authenticator.check_cached(key)
    info = await run_in_threadpool(authenticator.check, key) if isinstance(cached, NotCached) else cached
    if not isinstance(info, KeyInfo):
        # The key id (not secret) helps an operator spot a revoked key still in use; a string
        # that is not even key-shaped is not echoed at all.
        parsed = parse_key(key)
        key_id = parsed[0] if parsed else None
        if info is KeyRefusal.EXPIRED:
            log.warning("auth.refused", reason="expired_key", key_id=key_id, path=request.url.path)
            raise _unauthorized("This API key has expired: it was rotated and its overlap ended; "
                                "use its successor.")
        log.warning("auth.refused", reason="invalid_key", key_id=key_id, path=request.url.path)
        raise _unauthorized("Invalid or revoked API key.")
    address = request_client_address(request)
    if info.allowed_networks and not allowed(address, info.allowed_networks):
        raise _network_refused(request, info, str(address) if address is not None else "an unknown address")
    authenticator.note_use(info.key_id, str(address) if address is not None else None)
    caller = Caller(tenant=info.tenant, scopes=info.scopes, key_id=info.key_id)
    request.state.caller = caller
    return caller


def _network_refused(request: Request, info: KeyInfo, shown: str) -> ApiError:
    """The 403 of a key used from outside its ``allowed_networks``: logged, metered, audited."""
    path = request.url.path
    plane = plane_of_path(path).value
    record_network_refusal(plane=plane, reason="key")
    log.warning("auth.refused", reason=NETWORK_NOT_ALLOWED, key_id=info.key_id, tenant=info.tenant,
                client_address=shown, path=path)
    audit("network.refused", actor_tenant=info.tenant, actor_key_id=info.key_id, via="api",
          target=info.key_id, client_address=shown, reason="key", plane=plane, path=path)
    return ApiError(403, NETWORK_NOT_ALLOWED,
                    f"This API key may not be used from {shown}: the address is outside its "
                    "allowed networks.",
                    {"client_address": shown})


# --- taking the token (also api.admission's, for the submit path) ---------------------------------


def meter_caller(request: Request, caller: Caller) -> None:
    """Take one token from the caller's rate-limit bucket (one Redis round trip, which also
    reports a revocation): 401 revoked / 429 empty. Fails open without Redis: the rate limit
    protects capacity, and a submit needs Redis anyway. Blocking: call it off the event loop."""
    if caller.key_id is None:
        return
    try:
        decision = security_of(request).admission.check_rate(caller.key_id, key_id=caller.key_id)
    except redis.RedisError as exc:
        log.warning("rate_limit_unavailable", error=type(exc).__name__, key_id=caller.key_id)
        return
    enforce_rate(request, caller, decision)


def enforce_rate(request: Request, caller: Caller, decision: RateDecision | None) -> None:
    """Raise 401 for a key the rate script reports revoked, 429 for an empty bucket.

    ``decision`` None: the rate limit could not be checked (Redis unavailable): fail open.
    """
    _note_token_taken(request)
    if decision is None or caller.key_id is None:
        return
    if decision.revoked:
        _app_security(request).authenticator.forget(caller.key_id)
        log.warning("auth.refused", reason="revoked_key", key_id=caller.key_id, path=request.url.path)
        raise _unauthorized("Invalid or revoked API key.")
    if not decision.allowed:
        raise ApiError(429, "rate_limited", "Too many requests for this API key; slow down.",
                       {"retry_after_seconds": decision.retry_after_seconds},
                       {"Retry-After": str(decision.retry_after_seconds)})


async def meter_refused_request(request: Request) -> HTTPException | None:
    """Spend a rate-limit token for a request refused before its route could (issue 16: bodies
    that fail validation were never rate-limited, so a client could send them without end).

    Called by the validation error handler. The caller is the one the route's dependency
    authenticated, or, when the body was refused before any dependency ran (JSON that does not
    parse), the key in the request's header. Returns the 401/429 to answer instead of the 422, or
    None (already metered, no key, an invalid key: the 422 stands). The refusal comes back as an
    ``HTTPException`` carrying our error shape only because ``api.errors``' validation handler
    renders it with its ``HTTPException`` handler.
    """
    if token_taken(request):
        return None
    caller = getattr(request.state, "caller", None)
    if caller is None:
        try:
            caller = await _authenticate(request, await _bearer_scheme(request))
        except ApiError:
            return None
    if not isinstance(caller, Caller) or caller.key_id is None:
        return None
    try:
        await _take_token(request, caller)
    except ApiError as refused:
        detail = {"code": refused.code, "message": refused.message, "details": refused.details}
        return HTTPException(refused.status_code, detail=detail, headers=refused.headers)
    return None

