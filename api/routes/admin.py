"""``/v1/admin``: operate the service (admin scope only). Every call writes an audit line.

- workers: the live worker processes, their state and model version (worker registry);
- queues: depth, cap and drain state; drain / resume (``scheduler.fleet.queue_drain``);
- limits: rate limits and caps, changed at runtime (Redis; every API process sees them);
- tenants: a tenant's fair-share weight inside each class (``scheduler/fairness/weights.py``);
- keys: create / list / revoke / rotate API keys and set their networks (a key is shown once, in
  the create or rotate response).

Drains and limit changes are committed to SQL before Redis is written
(``scheduler.fleet.operator_state``), so they survive a Redis restart.

Model versions (list, activate, roll back) live in ``api/routes/admin_models.py``.
"""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Any

import redis
import structlog
from celery import Celery
from fastapi import APIRouter, Body, Query, Request
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.auth import Caller, security_of
from api.deps import AdminCaller, CeleryDep, SessionDep, SettingsDep
from api.errors import ApiError
from api.json_input import LimitedJsonRoute
from api.schemas.admin import (
    KeyCreate,
    KeyCreated,
    KeyId,
    KeyList,
    KeyNetworksUpdate,
    KeyOut,
    KeyRotate,
    KeyRotated,
    LimitsOut,
    LimitsUpdate,
    QueueAction,
    QueueList,
    QueueOut,
    TenantName,
    TenantWeight,
    TenantWeightOut,
    WorkerList,
    WorkerOut,
    key_out,
)
from api.schemas.errors import error_responses
from scheduler.access.admission import queue_depths
from scheduler.access.api_keys import (
    ApiKey,
    KeyNotFound,
    KeyNotRotatable,
    create_key,
    list_keys,
    revoke_key,
    rotate_key,
    set_key_networks,
)
from scheduler.access.key_revocations import mark_revoked
from scheduler.access.limit_overrides import effective_limits
from scheduler.access.retention import DEFAULT_FIELD, MAX_FIELD, override_field
from scheduler.fairness.weights import DEFAULT_WEIGHT, weight_field
from scheduler.fleet import operator_state, queue_drain
from scheduler.fleet.workers import WorkerInfo, list_workers
from scheduler.infra.redis_client import get_redis
from scheduler.infra.settings import Settings
from scheduler.jobs.models import QueueName
from scheduler.observability.audit import audit

log = structlog.get_logger(__name__)

router = APIRouter(prefix="/v1/admin", tags=["admin"], responses=error_responses(401, 403, 429, 503),
                   route_class=LimitedJsonRoute)

# Per-tenant retention overrides: (LIMITS_KEY field, TenantLimit attribute).
RETENTION_ATTRIBUTES = ((DEFAULT_FIELD, "retention_default_seconds"), (MAX_FIELD, "retention_max_seconds"))


def _registry(settings: Settings) -> Any:
    return get_redis(settings.resolved_redis_url)  # the process' shared client (app.state.redis too)


def _audit(caller: Caller, action: str, target: str | None = None, **details: Any) -> None:
    audit(action, actor_tenant=caller.tenant, actor_key_id=caller.key_id, via="api", target=target, **details)


def _node_name(worker: WorkerInfo) -> str:
    """Celery's node name of a registered worker: its id (``name@host``, the ``--hostname`` the
    worker was started with), else Celery's default ``celery@<host>``."""
    return worker.id if "@" in worker.id else f"celery@{worker.hostname}"


@router.get("/workers", response_model=WorkerList)
def get_workers(caller: AdminCaller, settings: SettingsDep) -> WorkerList:
    """Live workers: state, queues and model version (from their heartbeats in Redis)."""
    client = _registry(settings)
    workers = list_workers(client)
    _audit(caller, "workers.list", count=len(workers))
    return WorkerList(
        items=[
            WorkerOut(id=w.id, hostname=w.hostname, pid=w.pid, queues=list(w.queues), state=w.state,
                      model_version=w.model_version, started_at=w.started_at, heartbeat_at=w.heartbeat_at,
                      model_switch_error=w.stats.get("model_switch_error"))
            for w in workers
        ],
        drained_queues=sorted(queue_drain.drained_queues(client)),
        ready_per_queue=dict(sorted(Counter(q for w in workers if w.is_ready for q in w.queues).items())),
    )


@router.get("/queues", response_model=QueueList)
def get_queues(caller: AdminCaller, settings: SettingsDep) -> QueueList:
    """Every job queue: waiting messages, depth cap, drain state."""
    client = _registry(settings)
    names = [queue.value for queue in QueueName]
    depths = queue_depths(client, names)
    drained = queue_drain.drained_queues(client)
    caps = effective_limits(client, settings)["effective"]["queue_max_depth"]
    _audit(caller, "queues.list")
    return QueueList(
        items=[QueueOut(name=name, depth=depths[name], max_depth=caps.get(name, 0), drained=name in drained)
               for name in names]
    )


@router.post("/queues/{queue}/drain", response_model=QueueAction, responses=error_responses(422))
def drain_queue(queue: QueueName, caller: AdminCaller, session: SessionDep, settings: SettingsDep,
                celery: CeleryDep) -> QueueAction:
    """Workers stop taking jobs from ``queue`` (running jobs finish; submits still queue)."""
    return _set_drained(queue, True, caller=caller, session=session, settings=settings, celery=celery)


@router.post("/queues/{queue}/resume", response_model=QueueAction, responses=error_responses(422))
def resume_queue(queue: QueueName, caller: AdminCaller, session: SessionDep, settings: SettingsDep,
                 celery: CeleryDep) -> QueueAction:
    """Workers configured for ``queue`` consume it again."""
    return _set_drained(queue, False, caller=caller, session=session, settings=settings, celery=celery)


def _set_drained(queue: QueueName, drained: bool, *, caller: Caller, session: Session, settings: Settings,
                 celery: Celery) -> QueueAction:
    """Drain or resume ``queue`` (``operator_state.set_queue_drained``). A drain tells every
    registered worker; a resume only those configured for the queue."""
    client = _registry(settings)
    destinations = [_node_name(w) for w in list_workers(client) if drained or queue.value in w.queues]
    nodes = operator_state.set_queue_drained(session, client, celery, queue.value, drained=drained,
                                             destinations=destinations)
    _audit(caller, "queue.drain" if drained else "queue.resume", target=queue.value, nodes=nodes)
    return QueueAction(queue=queue.value, drained=drained, nodes=nodes)


@router.get("/limits", response_model=LimitsOut)
def get_limits(caller: AdminCaller, settings: SettingsDep) -> dict[str, Any]:
    """Rate limits and caps: defaults, runtime overrides, and what is in force."""
    _audit(caller, "limits.get")
    return effective_limits(_registry(settings), settings)


@router.patch("/limits", response_model=LimitsOut, responses=error_responses(404, 422))
def patch_limits(
    update: Annotated[LimitsUpdate, Body()], caller: AdminCaller, session: SessionDep, settings: SettingsDep
) -> dict[str, Any]:
    """Change limits at runtime for every API process. Omitted fields stay; null clears. A key
    override names a key that exists (404 ``key_not_found``: a mistyped id would otherwise be
    stored and limit nothing); clearing one (null) needs no key, so an ended key's can go."""
    setting = [key_id for key_id, rate in (update.keys or {}).items()
               if any(getattr(rate, name) is not None for name in rate.model_fields_set)]
    if setting:
        known = set(session.scalars(select(ApiKey.key_id).where(ApiKey.key_id.in_(setting))))
        for key_id in setting:
            if key_id not in known:
                raise _key_not_found(key_id)
    changes = _limit_changes(update)
    client = _registry(settings)
    operator_state.update_limits(session, client, changes)
    _audit(caller, "limits.update", changes=changes)
    return effective_limits(client, settings)


def _limit_changes(update: LimitsUpdate) -> dict[str, float | None]:
    changes: dict[str, float | None] = {}
    for name in ("rate_per_second", "rate_burst", "tenant_max_active"):
        if name in update.model_fields_set:
            changes[name] = getattr(update, name)
    for queue, cap in (update.queue_max_depth or {}).items():
        changes[f"queue_max_depth:{queue.value}"] = cap
    for tenant, limit in (update.tenants or {}).items():
        if "max_active" in limit.model_fields_set:
            changes[f"tenant_max_active:{tenant}"] = limit.max_active
        for field, attribute in RETENTION_ATTRIBUTES:
            if attribute in limit.model_fields_set:
                changes[override_field(field, tenant)] = getattr(limit, attribute)
        if "weight" in limit.model_fields_set:
            changes[weight_field(tenant)] = limit.weight
    for key_id, rate in (update.keys or {}).items():
        for name in ("rate_per_second", "rate_burst"):
            if name in rate.model_fields_set:
                changes[f"{name}:{key_id}"] = getattr(rate, name)
    return changes


@router.put("/tenants/{tenant}/weight", response_model=TenantWeightOut, responses=error_responses(422))
def put_tenant_weight(tenant: TenantName, body: Annotated[TenantWeight, Body()], caller: AdminCaller,
                      session: SessionDep, settings: SettingsDep) -> TenantWeightOut:
    """Set (or, with null, drop) a tenant's fair-share weight: while several tenants wait in a
    class, each gets capacity in proportion to its weight. Every releaser reads it at its next
    pass; it survives a Redis restart like every limit override."""
    operator_state.update_limits(session, _registry(settings), {weight_field(tenant): body.weight})
    _audit(caller, "tenant.weight", target=tenant, weight=body.weight)
    weight = body.weight if body.weight is not None else DEFAULT_WEIGHT
    return TenantWeightOut(tenant=tenant, weight=weight, overridden=body.weight is not None)


@router.get("/keys", response_model=KeyList)
def get_keys(
    caller: AdminCaller,
    session: SessionDep,
    tenant: Annotated[TenantName | None, Query(description="Only this tenant's keys.")] = None,
) -> KeyList:
    """API keys of every tenant (ids and scopes; secrets are never stored)."""
    _audit(caller, "keys.list", tenant=tenant)
    return KeyList(items=[KeyOut(**key_out(info)) for info in list_keys(session, tenant=tenant)])


@router.post("/keys", response_model=KeyCreated, status_code=201, responses=error_responses(422))
def post_key(body: Annotated[KeyCreate, Body()], caller: AdminCaller, session: SessionDep) -> KeyCreated:
    """Create a key; the response is the only place its secret ever appears."""
    created = create_key(session, tenant=body.tenant, scopes=body.scopes, label=body.label,
                         allowed_networks=body.allowed_networks)
    _audit(caller, "key.create", target=created.info.key_id, tenant=body.tenant,
           scopes=sorted(created.info.scopes), allowed_networks=created.info.networks)
    return KeyCreated(key=created.key, **key_out(created.info))


def _key_not_found(key_id: str) -> ApiError:
    return ApiError(404, "key_not_found", f"No key with id '{key_id}'.", {"key_id": key_id})


@router.patch("/keys/{key_id}", response_model=KeyOut, responses=error_responses(404, 422))
def patch_key(key_id: KeyId, body: Annotated[KeyNetworksUpdate, Body()], caller: AdminCaller,
              session: SessionDep, request: Request) -> KeyOut:
    """Replace a key's ``allowed_networks`` (empty or null: any address). This process applies it
    at once; other API processes within their key cache time (``auth_cache_seconds``)."""
    try:
        info = set_key_networks(session, key_id=key_id, allowed_networks=body.allowed_networks)
    except KeyNotFound:
        raise _key_not_found(key_id) from None
    security_of(request).authenticator.forget(key_id)
    _audit(caller, "key.set_networks", target=key_id, tenant=info.tenant, allowed_networks=info.networks)
    return KeyOut(**key_out(info))


@router.post("/keys/{key_id}/rotate", response_model=KeyRotated, status_code=201,
             responses=error_responses(404, 409, 422))
def post_rotate_key(key_id: KeyId, caller: AdminCaller, session: SessionDep, settings: SettingsDep,
                    request: Request, body: Annotated[KeyRotate | None, Body()] = None) -> KeyRotated:
    """Rotate a key: a successor with the same tenant, scopes, label and networks works at once
    (its key is shown only in this response); the old key keeps working for ``overlap_seconds``
    (no body: the default, a day, as the CLI's), then is refused (401). A revoked, expired or
    already rotated key answers 409 ``key_not_rotatable``."""
    body = body or KeyRotate()
    try:
        rotated = rotate_key(session, key_id=key_id, overlap_seconds=body.overlap_seconds)
    except KeyNotFound:
        raise _key_not_found(key_id) from None
    except KeyNotRotatable as exc:
        raise ApiError(409, "key_not_rotatable", f"Key '{key_id}' cannot be rotated: it is {exc.reason}.",
                       {"key_id": key_id, "reason": exc.reason}) from None
    security_of(request).authenticator.forget(key_id)
    if body.overlap_seconds == 0:  # ended and revoked now: every API process refuses it at once
        try:
            mark_revoked(_registry(settings), [key_id])
        except redis.RedisError as exc:  # the successor exists: its key must reach the caller
            log.warning("key.rotate_mark_failed", key_id=key_id, error=type(exc).__name__)
    successor = rotated.successor
    expires_at = rotated.previous.expires_at
    _audit(caller, "key.rotate", target=key_id, tenant=successor.info.tenant, previous_key_id=key_id,
           new_key_id=successor.info.key_id, overlap_seconds=body.overlap_seconds,
           previous_expires_at=expires_at.isoformat() if expires_at else None)
    return KeyRotated(key=successor.key, previous=KeyOut(**key_out(rotated.previous)),
                      **key_out(successor.info))


@router.post("/keys/{key_id}/revoke", response_model=KeyOut, responses=error_responses(404, 422))
def post_revoke_key(key_id: KeyId, caller: AdminCaller, session: SessionDep, settings: SettingsDep,
                    request: Request) -> KeyOut:
    """Revoke a key: every API process refuses it from now on."""
    info = revoke_key(session, key_id=key_id)
    if info is None:
        raise _key_not_found(key_id)
    mark_revoked(_registry(settings), [key_id])
    security_of(request).authenticator.forget(key_id)
    _audit(caller, "key.revoke", target=key_id, tenant=info.tenant)
    return KeyOut(**key_out(info))
