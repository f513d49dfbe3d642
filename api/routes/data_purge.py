"""``DELETE /v1/jobs/{id}/data`` and ``DELETE /v1/batches/{id}/data``: purge a job's data now.

A tenant need not wait for a job's retention to pass: these purge its input, output, partial
text, stream events and webhook bodies at once (``scheduler/maintenance/purge_requests.py``), and
answer the tombstone (the job, or the batch, as ``GET`` shows it from then on). Both are
idempotent. A job still queued or running keeps its data (it needs its input): ``409
job_not_finished``, nothing purged; cancel it first (``POST .../cancel``). A batch is purged only
when all its jobs are final (``409 batch_not_finished`` otherwise). ``submit`` scope, like cancel;
each purge writes an audit line (ids only).
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter

from api.deps import RedisDep, SessionDep, SettingsDep, SubmitCaller, visible_tenant
from api.errors import ApiError
from api.json_input import LimitedJsonRoute
from api.presenters import job_out
from api.routes.batches import _batch_out
from api.schemas.batches import BatchOut
from api.schemas.errors import error_responses
from api.schemas.jobs import JobOut
from scheduler.batches import service as batch_service
from scheduler.jobs import service as job_service
from scheduler.maintenance.data_purge import settle_seconds
from scheduler.maintenance.purge_requests import NotFinishedError, purge_batch_now, purge_job_now
from scheduler.observability.audit import audit

router = APIRouter(tags=["jobs"], responses=error_responses(401, 429), route_class=LimitedJsonRoute)


def _not_finished(code: str, what: str, details: dict[str, object]) -> ApiError:
    return ApiError(409, code, f"{what}: its input is still needed. Cancel first, or wait until it "
                    "finishes.", details)


@router.delete("/v1/jobs/{job_id}/data", response_model=JobOut,
               responses=error_responses(401, 403, 404, 409, 503))
def purge_job_data(job_id: str, session: SessionDep, redis: RedisDep, settings: SettingsDep,
                   caller: SubmitCaller) -> JobOut:
    """Purge a finished job's input, output, partial text, stream events and webhook bodies now;
    answers its tombstone (``purged_at`` set, ``result`` null). Idempotent."""
    try:
        parsed = uuid.UUID(job_id)
    except ValueError:
        parsed = None
    job = job_service.get_job(session, job_id=parsed, tenant=visible_tenant(caller)) if parsed else None
    if job is None:
        raise ApiError(404, "job_not_found", f"No job with id '{job_id}'.", {"job_id": job_id})
    try:
        purge_job_now(session, redis, job, settle=settle_seconds(settings))
    except NotFinishedError:
        raise _not_finished("job_not_finished", f"Job {job.id} is {job.status}",
                            {"job_id": str(job.id), "status": job.status}) from None
    audit("job.data_purged", actor_tenant=caller.tenant, actor_key_id=caller.key_id, via="api",
          target=str(job.id), tenant=job.tenant)
    purged = job_service.get_job(session, job_id=job.id, tenant=None)
    assert purged is not None
    return job_out(purged)


@router.delete("/v1/batches/{batch_id}/data", response_model=BatchOut,
               responses=error_responses(401, 403, 404, 409, 503))
def purge_batch_data(batch_id: str, session: SessionDep, redis: RedisDep, settings: SettingsDep,
                     caller: SubmitCaller) -> BatchOut:
    """Purge the data of every job of a finished batch now (all or nothing); answers the batch
    with ``purged_at`` set. Idempotent."""
    batch = batch_service.get_batch(session, batch_id=batch_id, tenant=visible_tenant(caller))
    if batch is None:
        raise ApiError(404, "batch_not_found", f"No batch with id '{batch_id}'.", {"batch_id": batch_id})
    try:
        jobs = purge_batch_now(session, redis, batch, settle=settle_seconds(settings))
    except NotFinishedError as exc:
        raise _not_finished("batch_not_finished", f"Batch {batch.id} has {exc.active} queued or running "
                            "job(s)", {"batch_id": str(batch.id), "active_jobs": exc.active}) from None
    audit("batch.data_purged", actor_tenant=caller.tenant, actor_key_id=caller.key_id, via="api",
          target=str(batch.id), tenant=batch.tenant, jobs=jobs)
    fresh = batch_service.get_batch(session, batch_id=batch.id, tenant=None)
    assert fresh is not None
    return _batch_out(batch_service.summarize(session, fresh))
