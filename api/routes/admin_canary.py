"""``/v1/admin/models/{name}/canary|promote|abort``: canary releases of a model version (admin).

The same operations as ``cloverq model canary / promote / abort``
(``scheduler/model_versions/canary.py``): each changes the model's one SQL row; canary workers and
stable workers follow within their poll interval. Promotion is refused (409 ``canary_gate_refused``,
with the tallies) while the canary finished too few jobs or fails more than the stable version
(``scheduler/model_versions/canary_gate.py``); ``force`` overrides. Every call writes an audit line.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body

from api.deps import AdminCaller, SessionDep, SettingsDep
from api.errors import ApiError
from api.json_input import LimitedJsonRoute
from api.routes.admin_models import ModelName, _audit, _models, _ready_by_version
from api.schemas.admin_models import CanaryRequest, ModelOut, PromoteRequest
from api.schemas.errors import error_responses
from scheduler.model_versions.canary import CanaryConflict, abort_canary, promote_canary, start_canary
from scheduler.model_versions.canary_gate import check_promotion
from scheduler.model_versions.registry import UnknownModelVersion, active_version

router = APIRouter(prefix="/v1/admin/models", tags=["admin"], responses=error_responses(401, 403, 429, 503),
                   route_class=LimitedJsonRoute)


def _conflict(exc: CanaryConflict, name: str) -> ApiError:
    return ApiError(409, "canary_conflict", str(exc), {"name": name})


@router.get("/{name}/canary", responses=error_responses(404))
def get_canary(
    name: ModelName, caller: AdminCaller, session: SessionDep, settings: SettingsDep
) -> dict[str, Any]:
    """The canary in effect and what the promotion gate says now (a dry run of ``promote``)."""
    current = active_version(session, name=name)
    if current is None:
        raise ApiError(404, "model_not_found", f"model {name!r} has no active version", {"name": name})
    if current.canary_version is None:
        return {"name": name, "stable": current.version, "canary": None, "gate": None}
    report = check_promotion(session, activation=current, settings=settings)
    return {"name": name, "stable": current.version, "gate": report.as_dict(),
            "canary": {"version": current.canary_version, "percent": current.canary_basis_points / 100,
                       "started_at": current.canary_started_at}}


@router.post("/{name}/canary", response_model=ModelOut, responses=error_responses(404, 409, 422))
def post_canary(
    name: ModelName, body: Annotated[CanaryRequest, Body()], caller: AdminCaller, session: SessionDep,
    settings: SettingsDep,
) -> ModelOut:
    """Route ``percent`` % of new jobs of ``name`` to ``version``; canary workers switch to it."""
    try:
        result = start_canary(session, name=name, version=body.version, percent=body.percent,
                              actor=f"api:{caller.key_id}", store_root=settings.resolved_model_root)
    except UnknownModelVersion as exc:
        details = {"name": name, "version": body.version}
        raise ApiError(404, "model_version_not_found", str(exc), details) from exc
    except CanaryConflict as exc:
        raise _conflict(exc, name) from exc
    except ValueError as exc:  # a share that rounds to 0 or 100 % (the schema's bounds keep it out)
        raise ApiError(422, "invalid_request", str(exc), {"percent": body.percent}) from exc
    _audit(caller, "model.canary", target=name, version=result.canary_version, percent=body.percent,
           stable=result.version)
    [model] = _models(session, _ready_by_version(settings), name=name)
    return model


@router.post("/{name}/promote", response_model=ModelOut, responses=error_responses(409, 422))
def post_promote(
    name: ModelName, caller: AdminCaller, session: SessionDep, settings: SettingsDep,
    body: Annotated[PromoteRequest | None, Body()] = None,
) -> ModelOut:
    """Make the canary the active version of ``name`` (the gate may refuse; ``force`` overrides)."""
    force = bool(body and body.force)
    current = active_version(session, name=name)
    if current is None or current.canary_version is None:
        raise ApiError(409, "canary_conflict", f"model {name!r} has no canary in effect", {"name": name})
    report = check_promotion(session, activation=current, settings=settings)
    if not report.ok and not force:  # every reason at once, the golden gate's among them
        raise ApiError(409, "canary_gate_refused", "; ".join(report.reasons), report.as_dict())
    try:
        result = promote_canary(session, name=name, actor=f"api:{caller.key_id}")
    except CanaryConflict as exc:
        raise _conflict(exc, name) from exc
    _audit(caller, "model.promote", target=name, version=result.version, previous=result.previous_version,
           forced=force and not report.ok, gate=report.as_dict())
    [model] = _models(session, _ready_by_version(settings), name=name)
    return model


@router.post("/{name}/abort", response_model=ModelOut, responses=error_responses(409))
def post_abort(name: ModelName, caller: AdminCaller, session: SessionDep, settings: SettingsDep) -> ModelOut:
    """End the canary of ``name``: its queued jobs go to the stable version, canary workers return."""
    try:
        result = abort_canary(session, name=name, actor=f"api:{caller.key_id}")
    except CanaryConflict as exc:
        raise _conflict(exc, name) from exc
    _audit(caller, "model.abort_canary", target=name, stable=result.version)
    [model] = _models(session, _ready_by_version(settings), name=name)
    return model
