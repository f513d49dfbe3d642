"""``/v1/jobs``: submit, read, list, cancel.

Routes are thin: validate against the deployment limits, call the job domain in
``scheduler.jobs.service`` (keyword-only functions), present the row. Every query is scoped to the
caller's tenant (admin keys see all tenants); another tenant's job is a plain 404.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Body, Header, Query, Request, Response
from redis import Redis, RedisError
from starlette.concurrency import run_in_threadpool

from api.admission import admit_submission
from api.auth import Caller, token_taken
from api.deps import (
    AdmittedSubmitCaller,
    JobReaderDep,
    ReadCaller,
    RedisDep,
    SessionDep,
    SettingsDep,
    SubmitCaller,
    TokenCounterDep,
    visible_tenant,
)
from api.errors import ApiError
from api.job_options import check_schedule, schedule_request, stored_events
from api.json_input import LimitedJsonRoute
from api.limits import check_job_limits
from api.presenters import job_out
from api.prompt_tokens import PromptTokenCounter
from api.retention import job_retention
from api.schemas.common import UtcDateTime
from api.schemas.errors import error_responses
from api.schemas.jobs import DecideJobCreate, ExtractJobCreate, GenerateJobCreate, JobCreate, JobList, JobOut
from scheduler.access.admission import forget_admitted
from scheduler.infra import redis_keys
from scheduler.infra.settings import Settings
from scheduler.jobs import service as job_service
from scheduler.jobs.models import JobKind, JobStatus, QueueName
from scheduler.jobs.routing import InvalidPriorityError
from scheduler.jobs.service import IdempotencyConflictError, InvalidCursorError
from scheduler.observability import tracing
from scheduler.observability.process_metrics import record_submitted

# Every route authenticates and is rate-limited per key (api.auth): 401 / 429 are possible anywhere.
router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=error_responses(401, 429),
                   route_class=LimitedJsonRoute)

log = structlog.get_logger(__name__)

MAX_IDEMPOTENCY_KEY_LENGTH = 200
MAX_WAIT_SECONDS = 30.0  # long polling; below common proxy idle timeouts (60 s)
MAX_PAGE = 200


def _job_not_found(job_id: str) -> ApiError:
    return ApiError(404, "job_not_found", f"No job with id '{job_id}'.", {"job_id": job_id})


def _parse_job_id(job_id: str) -> str:
    """A malformed id can name no job: 404, never a database type error."""
    try:
        return str(uuid.UUID(job_id))
    except ValueError:
        raise _job_not_found(job_id) from None


def _request_id(request: Request) -> str:
    """The id the observability middleware bound for this request (else the client's, else new)."""
    bound = getattr(request.state, "request_id", None)
    return bound or request.headers.get("x-request-id") or uuid.uuid4().hex


@router.post(
    "",
    status_code=202,
    response_model=JobOut,
    responses={200: {"model": JobOut, "description": "Idempotent repeat: the original job."},
               **error_responses(400, 401, 403, 409, 413, 422, 429, 503)},
)
async def submit_job(
    body: Annotated[JobCreate, Body()],
    request: Request,
    response: Response,
    caller: AdmittedSubmitCaller,  # its rate-limit token rides in the admission round trip
    settings: SettingsDep,
    counter: TokenCounterDep,
    idempotency_key: Annotated[
        str | None, Header(alias="Idempotency-Key", min_length=1, max_length=MAX_IDEMPOTENCY_KEY_LENGTH)
    ] = None,
) -> JobOut:
    """Queue a job and answer at once (202 + ``Location``); poll ``GET /v1/jobs/{id}``.

    With an ``Idempotency-Key`` a repeat returns the original job (200); the same key with a
    different body is a 409 ``idempotency_conflict``.
    """
    # All blocking work (token count, admission, insert, publish) in ONE thread-pool hop: the
    # submit path is the hot path, and every hop costs a context switch under load.
    job, created = await run_in_threadpool(
        _submit_blocking, body, request, caller, settings, counter, idempotency_key
    )
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    response.status_code = 202 if created else 200
    return job


def _submit_blocking(
    body: GenerateJobCreate | DecideJobCreate | ExtractJobCreate,
    request: Request,
    caller: Caller,
    settings: Settings,
    counter: PromptTokenCounter,
    idempotency_key: str | None,
) -> tuple[JobOut, bool]:
    # A refusal from here on spends the caller's token too: AdmittedSubmitCaller takes it if
    # the admission below did not run (and its 401 / 429 wins).
    counter = counter.for_request()  # the limits and the routing cost count the same texts once
    params = check_job_limits(body, settings=settings, counter=counter,
                              faults_enabled=settings.worker.fault_injection)
    prompt_tokens = counter.count(body.input.text_parts())  # the routing cost's prefill (issue 26)
    scheduled_for = check_schedule(body.not_before, body.delay_seconds, settings=settings)  # 422 first
    job_input = body.input.model_dump(exclude_none=True)
    job_id = uuid.uuid4()
    # The request's SERVER span (api/routes/metrics.py) is the job's submit span: the row stores its
    # ids (scheduler.jobs.service) and every attempt on a worker is its descendant. No span of its
    # own here: each span costs the submit path ~50 us of export encoding at sample ratio 1.
    traced = tracing.recording()  # once: a sampled-out submit builds no attributes
    if traced:
        tracing.annotate(tracing.job_attributes(job_id=job_id, tenant=caller.tenant, kind=str(body.kind)))
    job, created = _admit_and_store(body, request, caller, settings, params, job_input, job_id,
                                    idempotency_key, scheduled_for, prompt_tokens)
    if traced:
        tracing.annotate({**tracing.job_attributes(job_id=job.id, queue=job.queue),
                          "cloverq.job.created": int(created)})
    return job, created


def _admit_and_store(
    body: GenerateJobCreate | DecideJobCreate | ExtractJobCreate,
    request: Request,
    caller: Caller,
    settings: Settings,
    params: dict[str, Any],
    job_input: dict[str, Any],
    job_id: uuid.UUID,
    idempotency_key: str | None,
    scheduled_for: datetime | None = None,
    prompt_tokens: int = 0,
) -> tuple[JobOut, bool]:
    state = request.app.state
    marker = redis_keys.enqueued(job_id)
    with state.session_factory() as session:
        # 422 before admission: a retention above the tenant's maximum reserves and stores nothing.
        retention = job_retention(session, tenant=caller.tenant, requested=body.retention_seconds,
                                  settings=settings)
        # 429 before storing; when admitted, the same Redis round trip sets the enqueued marker.
        with tracing.step("cloverq.admission"):
            marker_set = admit_submission(request, session, caller, settings=settings, kind=body.kind,
                                          input=job_input, params=params, priority=body.priority,
                                          idempotency_key=idempotency_key, enqueued_marker=marker,
                                          metered=token_taken(request), prompt_tokens=prompt_tokens)
        created = False
        try:
            job, created = job_service.submit_job(
                session,
                tenant=caller.tenant,
                kind=body.kind,
                input=job_input,
                params=params,
                priority=body.priority,
                metadata=body.metadata,
                idempotency_key=idempotency_key,
                webhook_url=str(body.webhook_url) if body.webhook_url is not None else None,
                request_id=_request_id(request),
                settings=settings,
                celery=state.celery,
                redis_client=state.redis,
                job_id=job_id,
                marker_set=marker_set,
                scheduled_for=scheduled_for,  # delayed: no message now (scheduler/jobs/schedule.py)
                schedule_request=schedule_request(body.not_before, body.delay_seconds),
                webhook_events=stored_events(body.webhook_events, batch=False),
                retention_seconds=retention,
                prompt_tokens=prompt_tokens,
            )
        except IdempotencyConflictError as exc:
            raise ApiError(
                409,
                "idempotency_conflict",
                "This Idempotency-Key was already used with a different request body.",
                {"job_id": str(exc.job.id)},
            ) from exc
        except InvalidPriorityError as exc:
            details = [{"loc": ["body", "priority"], "message": str(exc), "type": "value_error"}]
            raise ApiError(422, "invalid_request", str(exc), details) from exc
        finally:
            if marker_set and not created:  # nothing stored under job_id (repeat, conflict, error)
                _drop_marker(state.redis, marker, caller.tenant)
        if created:
            record_submitted(kind=job.kind, queue=job.queue)  # in-process counter; no I/O
        return job_out(job), created


def _drop_marker(redis: Redis, marker: str, tenant: str) -> None:
    try:
        forget_admitted(redis, tenant=tenant, marker=marker)  # and the job's admission reservations
    except RedisError as exc:  # it expires on its own; the reconciler only reads markers of rows
        log.warning("job.marker_cleanup_failed", error=type(exc).__name__)


@router.get("/{job_id}", response_model=JobOut, responses=error_responses(401, 403, 404, 422, 503))
async def get_job(
    job_id: str,
    caller: ReadCaller,
    reader: JobReaderDep,
    wait: Annotated[float, Query(
        ge=0, le=MAX_WAIT_SECONDS,
        description="Long polling: answer as soon as the job is final, or after this many "
                    f"seconds (at most {MAX_WAIT_SECONDS:g}) with its status then. 0: at once. A replica "
                    "that is stopping answers by the end of its drain (api/drain.py): poll again.",
    )] = 0,
) -> JobOut:
    """Status, live progress, result or error, timings, attempts and model version of a job."""
    parsed = _parse_job_id(job_id)
    tenant = visible_tenant(caller)
    if wait <= 0:
        # One thread-pool hop for the SQL read and the Redis hot status (polling is a hot path too).
        job = await run_in_threadpool(reader.read, parsed, tenant)
    else:  # a stopping replica answers by its drain's deadline
        job = await reader.wait(parsed, tenant, deadline=time.monotonic() + wait)
    if job is None:
        raise _job_not_found(job_id)
    return job


@router.get("", response_model=JobList, responses=error_responses(401, 403, 422, 503))
def list_jobs(
    session: SessionDep,
    caller: ReadCaller,
    settings: SettingsDep,
    status: Annotated[JobStatus | None, Query(description="Filter by status.")] = None,
    kind: Annotated[JobKind | None, Query(description="Filter by kind.")] = None,
    queue: Annotated[QueueName | None, Query(description="Filter by queue.")] = None,
    created_after: Annotated[UtcDateTime | None, Query(description="With a UTC offset, e.g. ...Z.")] = None,
    created_before: Annotated[UtcDateTime | None, Query(description="With a UTC offset.")] = None,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
) -> Response:
    """Newest first; ``next_cursor`` is null on the last page.

    A page also ends before ``settings.limits.list_max_response_bytes`` (then ``next_cursor`` goes on
    from the last job shown), so large jobs never make one answer unbounded.
    """
    try:
        jobs, next_cursor = job_service.list_jobs(
            session,
            tenant=visible_tenant(caller),
            status=status,
            kind=kind,
            queue=queue,
            created_after=created_after,
            created_before=created_before,
            cursor=cursor,
            limit=limit,
        )
    except InvalidCursorError as exc:
        raise ApiError(422, "invalid_request", str(exc), [{"loc": ["query"], "message": str(exc)}]) from exc
    # Serialized here, once per job, to stop the page at the byte bound (a JobList body exactly).
    parts: list[bytes] = []
    size = 0
    for index, job in enumerate(jobs):
        part = job_out(job).model_dump_json().encode()
        if parts and size + len(part) > settings.limits.list_max_response_bytes:
            next_cursor = job_service.encode_cursor(jobs[index - 1])
            break
        parts.append(part)
        size += len(part) + 1
    body = b'{"items":[' + b",".join(parts) + b'],"next_cursor":' + json.dumps(next_cursor).encode() + b"}"
    return Response(body, media_type="application/json")


@router.post("/{job_id}/cancel", response_model=JobOut, responses=error_responses(401, 403, 404, 503))
def cancel_job(job_id: str, session: SessionDep, caller: SubmitCaller, settings: SettingsDep,
               redis: RedisDep) -> JobOut:
    """Cancel: a queued job at once, a running one within one denoising pass.

    Cancelling a finished job changes nothing and returns it as it is.
    """
    job = job_service.cancel_job(
        session, job_id=_parse_job_id(job_id), tenant=visible_tenant(caller),
        settings=settings, redis_client=redis,
    )
    if job is None:
        raise _job_not_found(job_id)
    return job_out(job)
