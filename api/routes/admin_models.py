"""``/v1/admin/models``: registered model versions, and switching the active one (admin scope).

Activation changes one SQL row (``scheduler.model_versions.registry``); every worker serving the model
notices within its poll interval, drains, loads the version from the store, warms up and only
then takes jobs again (``worker/model_switch_protocol.py``). Rollback is activating the previous version:
nothing is copied. Every call writes an audit line.
"""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Any

from fastapi import APIRouter, Body, Path
from sqlalchemy.orm import Session

from api.auth import Caller
from api.deps import AdminCaller, SessionDep, SettingsDep
from api.errors import ApiError
from api.json_input import LimitedJsonRoute
from api.schemas.admin_models import (
    ActivateRequest,
    CanaryOut,
    ModelList,
    ModelOut,
    ModelVersionOut,
    StoreComponent,
)
from api.schemas.errors import error_responses
from scheduler.fleet.workers import list_workers
from scheduler.infra.redis_client import get_redis
from scheduler.infra.settings import Settings
from scheduler.model_versions.registry import UnknownModelVersion, activate, list_active, list_registered
from scheduler.observability.audit import audit

router = APIRouter(prefix="/v1/admin/models", tags=["admin"], responses=error_responses(401, 403, 429, 503),
                   route_class=LimitedJsonRoute)

ModelName = Annotated[StoreComponent, Path(description="Model name (a folder of the model store).")]


def _ready_by_version(settings: Settings) -> Counter[str]:
    """Ready workers per served version (registry labels are ``<version>@<manifest digest>``)."""
    workers = list_workers(get_redis(settings.resolved_redis_url))
    return Counter((w.model_version or "").split("@", 1)[0] for w in workers if w.is_ready)


def _audit(caller: Caller, action: str, target: str | None = None, **details: Any) -> None:
    audit(action, actor_tenant=caller.tenant, actor_key_id=caller.key_id, via="api", target=target, **details)


def _models(session: Session, ready: Counter[str], *, name: str | None = None) -> list[ModelOut]:
    active = list_active(session)
    by_name: dict[str, list[ModelVersionOut]] = {}
    for row in list_registered(session, name=name):
        by_name.setdefault(row.name, []).append(
            ModelVersionOut(version=row.version, path=row.path, registered_at=row.registered_at,
                            active=row.active, ready_workers=ready.get(row.version, 0))
        )
    out = []
    for model, versions in sorted(by_name.items()):
        current = active.get(model)
        out.append(ModelOut(
            name=model, versions=versions,
            active_version=current.version if current else None,
            previous_version=current.previous_version if current else None,
            generation=current.generation if current else 0,
            activated_at=current.activated_at if current else None,
            activated_by=current.activated_by if current else None,
            canary=CanaryOut(version=current.canary_version, started_at=current.canary_started_at,
                             percent=current.canary_basis_points / 100)
            if current is not None and current.canary_version else None,
        ))
    return out


@router.get("", response_model=ModelList)
def get_models(caller: AdminCaller, session: SessionDep, settings: SettingsDep) -> ModelList:
    """Every registered model version, the active one per model, and the ready workers on each."""
    _audit(caller, "models.list")
    return ModelList(items=_models(session, _ready_by_version(settings)))


@router.post("/{name}/activate", response_model=ModelOut, responses=error_responses(404, 422))
def post_activate(
    name: ModelName, body: Annotated[ActivateRequest, Body()], caller: AdminCaller, session: SessionDep,
    settings: SettingsDep,
) -> ModelOut:
    """Make ``version`` the active version of ``name``: workers drain, load it, warm up, resume.

    The version must be registered (a worker served it, or ``cloverq model activate`` saw it in
    the store) or be published in the store this API process sees (``CLOVERQ_MODEL_ROOT``).
    """
    try:
        result = activate(session, name=name, version=body.version, actor=f"api:{caller.key_id}",
                          store_root=settings.resolved_model_root)
    except UnknownModelVersion as exc:
        details = {"name": name, "version": body.version}
        raise ApiError(404, "model_version_not_found", str(exc), details) from exc
    _audit(caller, "model.activate", target=name, version=result.version, previous=result.previous_version,
           generation=result.generation)
    [model] = _models(session, _ready_by_version(settings), name=name)
    return model
