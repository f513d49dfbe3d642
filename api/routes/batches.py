"""``/v1/batches``: submit many jobs at once, follow them, stream their results in order.

``POST /v1/batches`` takes a JSON object ``{"jobs": [...], "webhook_url", "metadata"}`` or
JSONL (one job spec per line) as the raw body or a multipart ``file``. Every spec is validated
exactly like ``POST /v1/jobs`` (same models, same limits); one bad spec rejects the batch with
its index. All rows are stored in ONE transaction, then published after the response (the
reconciler covers a failed publish). Batch jobs go to the ``bulk`` class. Admission is all or
nothing: every job counts against its queue cap and the tenant cap (429 before storing);
``batch_max_jobs`` bounds the size.
"""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Iterator
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, BackgroundTasks, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import TypeAdapter, ValidationError
from sqlalchemy.orm import Session

from api import json_input
from api.admission import admit_batch
from api.auth import Caller
from api.deps import (
    BatchUploadsDep,
    CeleryDep,
    ReadCaller,
    RedisDep,
    SessionDep,
    SessionFactoryDep,
    SettingsDep,
    SubmitCaller,
    TokenCounterDep,
    visible_tenant,
)
from api.errors import ApiError
from api.job_options import check_schedule, stored_events
from api.limit_messages import batch_too_large
from api.limits import check_job_limits, check_metadata, check_webhook_url
from api.prompt_tokens import PromptTokenCounter
from api.retention import batch_retention
from api.schemas.batches import BatchCreate, BatchOptions, BatchOut
from api.schemas.errors import error_responses
from api.schemas.jobs import JobCreate
from scheduler.batches import service as batch_service
from scheduler.infra.settings import Settings
from scheduler.jobs.models import utcnow
from scheduler.jobs.schedule import SCHEDULE_ERROR_CODE, is_delayed

# 401 / 429: every route authenticates and is rate-limited per key (api.auth).
router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=error_responses(401, 429),
                   route_class=json_input.LimitedJsonRoute)

JSONL_TYPES = ("application/x-ndjson", "application/jsonl", "application/json-lines", "text/jsonl")
MAX_REPORTED_ERRORS = 20
SPEC_SCHEDULE_MESSAGE = "a batch's jobs start together: give not_before / delay_seconds on the batch"
_SPEC = TypeAdapter(JobCreate)
# BatchOptions besides webhook_url and metadata: JSON fields, or query / form fields of an upload.
_EXTRA_OPTIONS = tuple(name for name in BatchOptions.model_fields if name not in ("webhook_url", "metadata"))

_OPENAPI_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/BatchCreate"}},
            "application/x-ndjson": {"schema": {"type": "string", "description": "one job spec per line"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary", "description": "JSONL job specs"},
                        "webhook_url": {"type": "string"},
                        "metadata": {"type": "string", "description": "a JSON object"},
                        "retention_seconds": {"type": "integer", "minimum": 0,
                                              "description": "data retention of the batch's jobs"},
                    },
                }
            },
        },
    }
}


def _batch_not_found(batch_id: str) -> ApiError:
    return ApiError(404, "batch_not_found", f"No batch with id '{batch_id}'.", {"batch_id": batch_id})


def _invalid(message: str, details: Any) -> ApiError:
    return ApiError(422, "invalid_request", message, details)


def _batch_out(summary: batch_service.BatchSummary) -> BatchOut:
    batch = summary.batch
    return BatchOut(
        id=str(batch.id), status=summary.status.value, total=batch.total, finished=summary.finished,
        counts=summary.counts, created_at=batch.created_at, cancel_requested=batch.cancel_requested,
        webhook_url=batch.webhook_url, metadata=batch.meta, results_url=f"/v1/batches/{batch.id}/results",
        retention_seconds=batch.retention_seconds, purged_at=batch.purged_at,
        scheduled_for=batch.scheduled_for,
        webhook_events=batch.webhook_events.split() if batch.webhook_events is not None else None,
    )


def _parse_jsonl(data: bytes) -> list[Any]:
    """One spec per line, read line by line from the bytes (no decoded copy of the whole body and
    no list of its lines: a 63 MiB upload cost 4.6 times its size in memory, issue 31)."""
    specs = []
    for number, line in enumerate(io.BytesIO(data), start=1):
        if not line.strip():
            continue
        try:
            specs.append(json_input.loads(line.decode("utf-8")))
        except json.JSONDecodeError as exc:
            raise _invalid(f"line {number} is not JSON: {exc.msg}", {"line": number}) from None
    return specs


def _validate_specs(raw: list[Any], *, settings: Settings, counter: PromptTokenCounter) -> list[
    batch_service.JobSpec
]:
    """Every spec through the job models and limits; errors name the spec's index."""
    if not raw:
        raise _invalid("a batch needs at least one job", {"loc": ["body", "jobs"]})
    if len(raw) > settings.batches.max_jobs:
        raise batch_too_large(len(raw), settings)  # names the setting, says into how many to split
    specs, errors = [], []
    counter = counter.for_request()  # a batch of jobs over one contract tokenizes it once
    for index, item in enumerate(raw):
        try:
            body = _SPEC.validate_python(item)
            params = check_job_limits(body, settings=settings, counter=counter,
                                      faults_enabled=settings.worker.fault_injection)
        except ValidationError as exc:
            errors.append({"index": index, "errors": exc.errors(include_url=False, include_context=False)})
        except ApiError as exc:
            errors.append({"index": index, "code": exc.code, "message": exc.message})
        else:
            if body.not_before is not None or body.delay_seconds is not None:
                errors.append({"index": index, "code": SCHEDULE_ERROR_CODE, "message": SPEC_SCHEDULE_MESSAGE})
                continue
            specs.append(batch_service.JobSpec(
                kind=body.kind, input=body.input.model_dump(exclude_none=True), params=params,
                priority=body.priority, metadata=body.metadata,
                webhook_url=str(body.webhook_url) if body.webhook_url is not None else None,
                retention_seconds=body.retention_seconds,  # the request's; resolved at store time
                webhook_events=stored_events(body.webhook_events, batch=False),
                prompt_tokens=counter.count(body.input.text_parts()),  # the routing cost (issue 26)
            ))
        if len(errors) >= MAX_REPORTED_ERRORS:
            break
    if errors:  # the error renderer copes with whatever the specs held (api.errors.json_safe)
        raise _invalid(f"{len(errors)} job spec(s) are invalid (first {MAX_REPORTED_ERRORS} reported)",
                       errors)
    return specs


async def _read_batch(request: Request) -> tuple[
    list[Any], str | None, dict[str, Any] | None, dict[str, Any]
]:
    """(raw specs, webhook_url, metadata, the other ``BatchOptions`` given) from JSON, raw JSONL or
    a multipart upload (then the other options are query or form fields, validated as the JSON's)."""
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        form = await request.form()
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise _invalid("multipart batches need a 'file' field with JSONL", {"loc": ["body", "file"]})
        text = await upload.read()  # bytes, parsed line by line
        webhook = form.get("webhook_url")
        metadata = form.get("metadata")
        try:
            parsed_metadata = json_input.loads(str(metadata)) if metadata else None
        except json.JSONDecodeError as exc:
            raise _invalid(f"the metadata field is not JSON: {exc.msg}",
                           {"loc": ["body", "metadata"]}) from None
        extra = {name: form[name] for name in _EXTRA_OPTIONS if isinstance(form.get(name), str)}
        return _parse_jsonl(text), str(webhook) if webhook else None, parsed_metadata, extra
    body = await request.body()
    if content_type in JSONL_TYPES:
        webhook = request.query_params.get("webhook_url")
        extra = {name: request.query_params[name] for name in _EXTRA_OPTIONS if name in request.query_params}
        return _parse_jsonl(body), webhook, None, extra
    if content_type != "application/json":
        raise ApiError(415, "unsupported_media_type",
                       "send application/json, application/x-ndjson or multipart/form-data",
                       {"content_type": content_type})
    try:
        data = json_input.loads(body)
    except json.JSONDecodeError as exc:
        raise _invalid(f"the body is not JSON: {exc.msg}", {"loc": ["body"]}) from None
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), list):
        raise _invalid('the body must be an object with a "jobs" list', {"loc": ["body", "jobs"]})
    unknown = set(data) - set(BatchCreate.model_fields)
    if unknown:
        raise _invalid(f"unknown fields: {sorted(unknown)}", {"loc": ["body"], "fields": sorted(unknown)})
    return (data["jobs"], data.get("webhook_url"), data.get("metadata"),
            {name: data[name] for name in _EXTRA_OPTIONS if name in data})


def _validate_options(webhook_url: Any, metadata: Any, *, settings: Settings,
                      extra: dict[str, Any] | None = None) -> BatchOptions:
    try:
        given = {"webhook_url": webhook_url, "metadata": metadata, **(extra or {})}
        options = BatchOptions.model_validate(given)
    except ValidationError as exc:
        raise _invalid("invalid batch options",
                       exc.errors(include_url=False, include_context=False)) from None
    check_metadata(options.metadata, settings=settings)
    webhook = str(options.webhook_url) if options.webhook_url is not None else None
    check_webhook_url(webhook, settings=settings)
    return options


@router.post(
    "",
    status_code=202,
    response_model=BatchOut,
    openapi_extra=_OPENAPI_BODY,
    responses=error_responses(401, 403, 413, 415, 422, 429, 503),
)
async def create_batch(
    request: Request,
    response: Response,
    background: BackgroundTasks,
    session: SessionDep,
    caller: SubmitCaller,
    settings: SettingsDep,
    counter: TokenCounterDep,
    slots: BatchUploadsDep,
    celery: CeleryDep,
    redis: RedisDep,
    sessions: SessionFactoryDep,
) -> BatchOut:
    """Store up to ``batch_max_jobs`` job specs in one transaction (202 + ``Location``)."""
    acquired = False
    with anyio.move_on_after(settings.batches.upload_wait_seconds):
        await slots.acquire()
        acquired = True
    if not acquired:
        raise ApiError(503, "uploads_busy", "This API process is parsing as many batch uploads as it may; "
                       "retry shortly.", {"max_concurrent_uploads": settings.batches.max_concurrent_uploads},
                       headers={"Retry-After": "2"})
    try:
        try:
            raw, webhook_url, metadata, extra = await _read_batch(request)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _invalid(f"the upload is not UTF-8 JSONL: {exc}", {"loc": ["body"]}) from None
        options = _validate_options(webhook_url, metadata, settings=settings, extra=extra)
        webhook = str(options.webhook_url) if options.webhook_url is not None else None
        scheduled_for = check_schedule(options.not_before, options.delay_seconds, settings=settings)
        events = stored_events(options.webhook_events, batch=True)
        specs = await anyio.to_thread.run_sync(
            lambda: _validate_specs(raw, settings=settings, counter=counter))
        raw.clear()  # the parsed documents: only the validated specs are kept (and stored)
    finally:
        slots.release()
    request_id = getattr(request.state, "request_id", None) or request.headers.get("x-request-id")

    def store() -> tuple[batch_service.Batch, list[tuple[uuid.UUID, str]], batch_service.BatchSummary]:
        retention, kept = batch_retention(session, tenant=caller.tenant, specs=specs,  # 422 first
                                          requested=options.retention_seconds, settings=settings)
        job_ids = admit_batch(request, session, caller, settings=settings, specs=kept)  # 429 before storing
        batch, jobs = batch_service.create_batch(
            session, tenant=caller.tenant, specs=kept, settings=settings, webhook_url=webhook,
            metadata=options.metadata, request_id=request_id, job_ids=job_ids, retention_seconds=retention,
            scheduled_for=scheduled_for, webhook_events=events,
        )
        return batch, jobs, batch_service.summarize(session, batch)

    batch, jobs, summary = await anyio.to_thread.run_sync(store)
    if is_delayed(batch.scheduled_for, utcnow()):  # the beat's delayed tick publishes them when due
        background.add_task(batch_service.hold_batch, jobs, redis_client=redis, tenant=caller.tenant)
    else:
        background.add_task(batch_service.publish_batch, jobs, app=celery, redis_client=redis,
                            request_id=request_id, tenant=caller.tenant,  # releases the jobs' reservations
                            settings=settings, sessions=sessions)  # fair share: held, by DRR
    response.headers["Location"] = f"/v1/batches/{batch.id}"
    return _batch_out(summary)


def _load(session: Session, caller: Caller, batch_id: str) -> batch_service.Batch:
    batch = batch_service.get_batch(session, batch_id=batch_id, tenant=visible_tenant(caller))
    if batch is None:
        raise _batch_not_found(batch_id)
    return batch


@router.get("/{batch_id}", response_model=BatchOut, responses=error_responses(401, 403, 404, 503))
def get_batch(batch_id: str, session: SessionDep, caller: ReadCaller) -> BatchOut:
    """The batch with its job counts by status."""
    return _batch_out(batch_service.summarize(session, _load(session, caller, batch_id)))


@router.get(
    "/{batch_id}/results",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}},
                     "description": "One JSON object per job, in submission order."},
               **error_responses(401, 403, 404, 503)},
)
def batch_results(
    batch_id: str, session: SessionDep, sessions: SessionFactoryDep, caller: ReadCaller
) -> StreamingResponse:
    """JSONL, one line per job in submission order: index, job_id, status, result, error.

    Streamed in keyset pages (constant memory); jobs not yet final appear with their status
    and no result.
    """
    batch = _load(session, caller, batch_id)

    def lines() -> Iterator[bytes]:
        for line in batch_service.iter_results(sessions, batch_id=batch.id):
            yield (json.dumps(line, separators=(",", ":"), default=str) + "\n").encode()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.post("/{batch_id}/cancel", response_model=BatchOut, responses=error_responses(401, 403, 404, 503))
def cancel_batch(batch_id: str, session: SessionDep, caller: SubmitCaller, settings: SettingsDep,
                 redis: RedisDep) -> BatchOut:
    """Cancel every queued job at once and signal the running ones (they stop within a pass)."""
    batch = _load(session, caller, batch_id)
    summary = batch_service.cancel_batch(session, batch=batch, settings=settings, redis_client=redis)
    return _batch_out(summary)
