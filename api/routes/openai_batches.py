"""OpenAI's Files and Batch APIs, mapped onto cloverq batches.

- Files (``/v1/files`` and ``/openai/v1/files``): upload (multipart ``file`` + ``purpose``;
  only ``batch`` is accepted), list, get, content, delete. Rows of ``openai_files``.
- Batches (``/openai/v1/batches`` only: ``/v1/batches`` is cloverq's own batch API, so OpenAI
  clients use ``base_url="http://HOST/openai/v1"``): create from an uploaded JSONL file of
  ``{"custom_id", "method": "POST", "url", "body"}`` lines, get, list, cancel.

Creating a batch validates every line as its endpoint (``/v1/chat/completions`` or
``/v1/completions``) would (``api/openai_compat.py``) and then as ``POST /v1/batches`` validates
its specs (``api/routes/batches.py``: same models and limits), so a bad line refuses the whole
batch with a 400 naming the line; admission is all or nothing (``api/admission.py``
``admit_batch``: 429 before anything is stored). One cloverq batch holds the jobs (bulk class,
submission order); ``scheduler/batches/openai_batches.py`` keeps each line's ``custom_id``. The output
and error files (``output_file_id`` / ``error_file_id`` once the batch is final) are rendered
from the jobs when read: one line per request, ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}``, in submission order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Annotated, Any

import anyio.to_thread
from fastapi import APIRouter, BackgroundTasks, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy.orm import Session, sessionmaker

from api import json_input
from api import openai_compat as oa
from api.admission import admit_batch
from api.auth import Caller
from api.deps import (
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
from api.errors import ApiError, openai_error_body
from api.presenters import job_out
from api.prompt_tokens import PromptTokenCounter
from api.retention import batch_retention
from api.routes.batches import _validate_specs as validate_specs  # the checks of POST /v1/batches
from api.schemas.common import MAX_RETENTION_SECONDS
from scheduler.batches import openai_batches as store
from scheduler.batches import service as batch_service
from scheduler.batches.service import BatchStatus
from scheduler.infra.settings import Settings
from scheduler.jobs.models import FINAL_STATUSES, Job, JobStatus, as_utc

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS = ("24h",)
WINDOW = timedelta(hours=24)
PURPOSES = ("batch",)
MAX_REPORTED = 20
MAX_CUSTOM_ID = 512
# Our batch status -> the OpenAI batch status.
STATUS: dict[str, str] = {BatchStatus.RUNNING: "in_progress", BatchStatus.CANCELLING: "cancelling",
                          BatchStatus.COMPLETED: "completed", BatchStatus.CANCELLED: "cancelled"}


def _unix(value: datetime | None) -> int | None:
    return int(as_utc(value).timestamp()) if value is not None else None


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, code, message, None, param=param)


def _file_not_found(file_id: str) -> ApiError:
    return ApiError(404, "file_not_found", f"No file with id '{file_id}'.", {"file_id": file_id},
                    param="file_id")


def _batch_not_found(batch_id: str) -> ApiError:
    return ApiError(404, "batch_not_found", f"No batch with id '{batch_id}'.", {"batch_id": batch_id},
                    param="batch_id")


# --- files ------------------------------------------------------------------------------------------


def _file_out(row: store.OpenAIFile) -> dict[str, Any]:
    return {"id": row.id, "object": "file", "bytes": row.bytes, "created_at": _unix(row.created_at),
            "filename": row.filename, "purpose": row.purpose, "status": "processed",
            "expires_at": None, "status_details": None}


async def upload_file(request: Request, session: SessionDep, caller: SubmitCaller) -> dict[str, Any]:
    """OpenAI ``POST /files`` (multipart: ``file``, ``purpose``)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "multipart/form-data":
        raise ApiError(415, "unsupported_media_type", "upload files as multipart/form-data",
                       {"content_type": content_type})
    form = await request.form()
    purpose = form.get("purpose")
    upload = form.get("file")
    if not isinstance(purpose, str) or purpose not in PURPOSES:
        raise _bad(f"'purpose' must be one of {list(PURPOSES)} (cloverq runs batches only).", "purpose")
    if upload is None or isinstance(upload, str):
        raise _bad("a 'file' field with the JSONL content is required", "file")
    content = await upload.read()
    try:
        content.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad("the file is not UTF-8 text", "file") from None
    filename = (upload.filename or "upload.jsonl")[:255]

    def insert() -> store.OpenAIFile:
        return store.create_file(session, tenant=caller.tenant, purpose=purpose, filename=filename,
                                 content=content)

    return _file_out(await anyio.to_thread.run_sync(insert))


def list_files(session: SessionDep, caller: ReadCaller,
               purpose: Annotated[str | None, Query(max_length=32)] = None,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
               after: Annotated[str | None, Query(max_length=64)] = None) -> dict[str, Any]:
    """OpenAI ``GET /files`` (the uploaded files, newest first)."""
    rows, more = store.list_files(session, tenant=visible_tenant(caller), purpose=purpose, limit=limit,
                                  after=after)
    data = [_file_out(row) for row in rows]
    return {"object": "list", "data": data, "has_more": more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


def _rendered(session: Session, caller: Caller, file_id: str) -> tuple[store.OpenAIBatch, str] | None:
    rendered = store.rendered_file(file_id)
    if rendered is None:
        return None
    batch_id, kind = rendered
    row = store.get_openai_batch(session, batch_id=batch_id, tenant=visible_tenant(caller))
    if row is None:
        raise _file_not_found(file_id)
    return row, kind


def get_file(file_id: str, session: SessionDep, sessions: SessionFactoryDep, caller: ReadCaller
             ) -> dict[str, Any]:
    """OpenAI ``GET /files/{id}``."""
    rendered = _rendered(session, caller, file_id)
    if rendered is not None:
        row, kind = rendered
        size = sum(len(line) for line in _output_lines(sessions, row, kind))
        return {"id": file_id, "object": "file", "bytes": size, "created_at": _unix(row.created_at),
                "filename": f"{row.id}_{kind}.jsonl", "purpose": "batch_output", "status": "processed",
                "expires_at": None, "status_details": None}
    found = store.get_file(session, file_id=file_id, tenant=visible_tenant(caller))
    if found is None:
        raise _file_not_found(file_id)
    return _file_out(found)


def file_content(file_id: str, session: SessionDep, sessions: SessionFactoryDep, caller: ReadCaller
                 ) -> Response:
    """OpenAI ``GET /files/{id}/content``: the uploaded bytes, or a batch's output / errors JSONL."""
    rendered = _rendered(session, caller, file_id)
    if rendered is not None:
        row, kind = rendered
        return StreamingResponse(_output_lines(sessions, row, kind), media_type="application/jsonl")
    found = store.get_file(session, file_id=file_id, tenant=visible_tenant(caller))
    if found is None:
        raise _file_not_found(file_id)
    return Response(found.content, media_type="application/jsonl")


def delete_file(file_id: str, session: SessionDep, caller: SubmitCaller) -> dict[str, Any]:
    """OpenAI ``DELETE /files/{id}`` (an uploaded file; batches made from it keep running)."""
    if store.rendered_file(file_id) is not None or not store.delete_file(
        session, file_id=file_id, tenant=visible_tenant(caller)
    ):
        raise _file_not_found(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


# --- batches ----------------------------------------------------------------------------------------


class BatchCreateBody(BaseModel):
    """OpenAI ``POST /batches``."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)
    output_expires_after: dict[str, Any] | None = None  # accepted; rendered files do not expire
    # cloverq's extension: data retention of the batch's jobs (docs/security.md#retention)
    retention_seconds: int | None = Field(None, ge=0, le=MAX_RETENTION_SECONDS)


def _line_request(endpoint: str, body: Any, settings: Settings) -> tuple[dict[str, Any], dict[str, Any]]:
    """(cloverq job spec, what the answer needs) of one line's ``body``."""
    if isinstance(body, dict) and body.get("stream"):
        raise _bad("a batch request cannot stream", "body.stream")
    if endpoint == "/v1/chat/completions":
        chat = oa.parse_request(oa.ChatCompletionRequest, body)
        oa.check_model(chat.model, settings)
        job = oa.chat_job(chat)
        info = {"model": chat.model, "stop": oa.stop_sequences(chat.stop), "echo": None}
    else:
        completion = oa.parse_request(oa.CompletionRequest, body)
        oa.check_model(completion.model, settings)
        job = oa.completion_job(completion)
        echo = oa.completion_prompt(completion) if completion.echo else None
        info = {"model": completion.model, "stop": oa.stop_sequences(completion.stop), "echo": echo}
    return job.model_dump(mode="json", exclude_none=True), info


def _read_lines(content: bytes, endpoint: str, settings: Settings) -> tuple[list[dict[str, Any]],
                                                                          list[dict[str, Any]], list[int]]:
    """(job specs, per-line info with custom_id, line numbers) of an input file; 400 naming the
    first bad lines."""
    specs: list[dict[str, Any]] = []
    infos: list[dict[str, Any]] = []
    numbers: list[int] = []
    errors: list[str] = []
    seen: set[str] = set()
    for number, line in enumerate(content.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json_input.loads(line)
            if not isinstance(item, dict):
                raise _bad("a line must be a JSON object")
            custom_id = item.get("custom_id")
            if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
                raise _bad(f"'custom_id' must be a string of 1 to {MAX_CUSTOM_ID} characters")
            if custom_id in seen:
                raise _bad(f"duplicate custom_id {custom_id!r}")
            if item.get("method", "POST") != "POST":
                raise _bad("'method' must be POST")
            if item.get("url") != endpoint:
                raise _bad(f"'url' must be the batch's endpoint {endpoint}")
            unknown = set(item) - {"custom_id", "method", "url", "body"}
            if unknown:
                raise _bad(f"unknown fields {sorted(unknown)}")
            spec, info = _line_request(endpoint, item.get("body"), settings)
        except json.JSONDecodeError as exc:
            errors.append(f"line {number}: not JSON ({exc.msg})")
        except ApiError as exc:
            param = f" ({exc.param})" if exc.param else ""
            errors.append(f"line {number}{param}: {exc.message}")
        else:
            seen.add(custom_id)
            specs.append(spec)
            infos.append({"custom_id": custom_id, **info})
            numbers.append(number)
        if len(errors) >= MAX_REPORTED:
            break
    if errors:
        raise ApiError(400, "invalid_batch_input", f"{len(errors)} line(s) of the input file are invalid: "
                       + "; ".join(errors), {"errors": errors}, param="input_file_id")
    if not specs:
        raise _bad("the input file holds no requests", "input_file_id", code="invalid_batch_input")
    return specs, infos, numbers


def _validated_specs(raw: list[dict[str, Any]], numbers: list[int], *, settings: Settings,
                     counter: PromptTokenCounter) -> list[batch_service.JobSpec]:
    try:
        return validate_specs(raw, settings=settings, counter=counter)
    except ApiError as exc:
        entries = exc.details if isinstance(exc.details, list) else []
        named = [f"line {numbers[e['index']]}: {e.get('message') or e.get('errors')}"
                 for e in entries if isinstance(e, dict) and isinstance(e.get("index"), int)]
        message = "; ".join(named) if named else exc.message
        status = 400 if exc.status_code == 422 else exc.status_code
        raise ApiError(status, exc.code if exc.code != "invalid_request" else "invalid_batch_input",
                       message, exc.details, param="input_file_id") from None


def _counts(summary: batch_service.BatchSummary) -> dict[str, int]:
    completed = summary.counts.get(JobStatus.SUCCEEDED.value, 0)
    failed = sum(summary.counts.get(s.value, 0) for s in FINAL_STATUSES if s is not JobStatus.SUCCEEDED)
    return {"total": summary.batch.total, "completed": completed, "failed": failed}


def _batch_out(session: SessionDep, row: store.OpenAIBatch) -> dict[str, Any]:
    batch = batch_service.get_batch(session, batch_id=row.batch_id, tenant=None)
    assert batch is not None
    summary = batch_service.summarize(session, batch)
    status = STATUS.get(summary.status, "in_progress")
    counts = _counts(summary)
    final = status in ("completed", "cancelled")
    ended = _unix(store.last_finished_at(session, row.batch_id)) if final else None
    return {
        "id": row.id, "object": "batch", "endpoint": row.endpoint, "errors": None,
        "input_file_id": row.input_file_id, "completion_window": row.completion_window, "status": status,
        "output_file_id": store.output_file_id(row.id) if final and counts["completed"] else None,
        "error_file_id": store.error_file_id(row.id) if final and counts["failed"] else None,
        "created_at": _unix(row.created_at), "in_progress_at": _unix(row.created_at),
        "expires_at": _unix(row.created_at + WINDOW),
        "finalizing_at": ended, "completed_at": ended if status == "completed" else None,
        "failed_at": None, "expired_at": None, "cancelling_at": _unix(row.cancelling_at),
        "cancelled_at": ended if status == "cancelled" else None,
        "request_counts": counts, "metadata": row.meta,
        "cloverq_batch_id": str(row.batch_id),
    }


async def create_batch(request: Request, background: BackgroundTasks, session: SessionDep,
                       caller: SubmitCaller, settings: SettingsDep, counter: TokenCounterDep,
                       celery: CeleryDep, redis: RedisDep, sessions: SessionFactoryDep) -> dict[str, Any]:
    """OpenAI ``POST /batches``: one cloverq batch with one job per line of the input file."""
    try:
        raw = await request.json()
    except json.JSONDecodeError as exc:
        raise _bad(f"The body is not valid JSON: {exc.msg}") from None
    try:
        body = BatchCreateBody.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in first.get("loc", ()))
        raise _bad(f"Invalid value for '{param}': {first.get('msg')}", param) from None
    if body.endpoint not in ENDPOINTS:
        raise _bad(f"'endpoint' must be one of {list(ENDPOINTS)}", "endpoint", code="unsupported_parameter")
    if body.completion_window not in COMPLETION_WINDOWS:
        raise _bad("'completion_window' must be '24h'", "completion_window")
    tenant = caller.tenant
    found = await anyio.to_thread.run_sync(
        lambda: store.get_file(session, file_id=body.input_file_id, tenant=visible_tenant(caller)))
    if found is None or found.purpose != "batch":
        raise _file_not_found(body.input_file_id)
    content = found.content
    raw_specs, infos, numbers = await anyio.to_thread.run_sync(
        lambda: _read_lines(content, body.endpoint, settings))
    specs = await anyio.to_thread.run_sync(
        lambda: _validated_specs(raw_specs, numbers, settings=settings, counter=counter))
    request_id = getattr(request.state, "request_id", None) or request.headers.get("x-request-id")
    openai_id = store.new_batch_id()

    def persist() -> tuple[store.OpenAIBatch, list[Any]]:
        retention, kept = batch_retention(session, tenant=tenant, specs=specs,  # 422 before admission
                                          requested=body.retention_seconds, settings=settings)
        job_ids = admit_batch(request, session, caller, settings=settings, specs=kept)  # 429 before storing
        batch, jobs = batch_service.create_batch(
            session, tenant=tenant, specs=kept, settings=settings, metadata={"openai_batch_id": openai_id},
            request_id=request_id, job_ids=job_ids, retention_seconds=retention,
        )
        row = store.create_openai_batch(
            session, batch_id=openai_id, tenant=tenant, cloverq_batch_id=batch.id,
            input_file_id=body.input_file_id, endpoint=body.endpoint,
            completion_window=body.completion_window, metadata=body.metadata, requests=infos,
        )
        return row, jobs

    row, jobs = await anyio.to_thread.run_sync(persist)
    background.add_task(batch_service.publish_batch, jobs, app=celery, redis_client=redis,
                        request_id=request_id, tenant=tenant,  # releases the jobs' reservations
                        settings=settings, sessions=sessions)  # fair share: held, by DRR
    return await anyio.to_thread.run_sync(lambda: _batch_out(session, row))


def _load(session: Session, caller: Caller, batch_id: str) -> store.OpenAIBatch:
    row = store.get_openai_batch(session, batch_id=batch_id, tenant=visible_tenant(caller))
    if row is None:
        raise _batch_not_found(batch_id)
    return row


def get_batch(batch_id: str, session: SessionDep, caller: ReadCaller) -> dict[str, Any]:
    """OpenAI ``GET /batches/{id}``."""
    return _batch_out(session, _load(session, caller, batch_id))


def list_batches(session: SessionDep, caller: ReadCaller,
                 limit: Annotated[int, Query(ge=1, le=100)] = 20,
                 after: Annotated[str | None, Query(max_length=64)] = None) -> dict[str, Any]:
    """OpenAI ``GET /batches`` (newest first)."""
    rows, more = store.list_openai_batches(session, tenant=visible_tenant(caller), limit=limit, after=after)
    data = [_batch_out(session, row) for row in rows]
    return {"object": "list", "data": data, "has_more": more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


def cancel_batch(
    batch_id: str, session: SessionDep, settings: SettingsDep, redis: RedisDep, caller: SubmitCaller
) -> dict[str, Any]:
    """OpenAI ``POST /batches/{id}/cancel``: queued jobs are cancelled at once, running ones stop
    within a pass (``scheduler.batches.service.cancel_batch``)."""
    row = _load(session, caller, batch_id)
    batch = batch_service.get_batch(session, batch_id=row.batch_id, tenant=None)
    assert batch is not None
    summary = batch_service.cancel_batch(session, batch=batch, settings=settings, redis_client=redis)
    if summary.batch.cancel_requested:  # a batch already finished is returned unchanged, not "cancelling"
        store.mark_cancelling(session, row)
    return _batch_out(session, row)


# --- output files -----------------------------------------------------------------------------------


def _line(row: store.OpenAIBatch, seq: int, job: Job) -> tuple[str, dict[str, Any]]:
    """(``output`` | ``errors``, the line) of one job of the batch."""
    info = row.requests[seq] if seq < len(row.requests) else {}
    view = job_out(job)
    base = {"id": f"batch_req_{job.id.hex}", "custom_id": info.get("custom_id")}
    request_id = job.request_id or str(job.id)
    if view.status == JobStatus.SUCCEEDED:
        stops = info.get("stop") or []
        if row.endpoint == "/v1/chat/completions":
            body = oa.chat_response(view, model=info.get("model") or "", stops=stops)
        else:
            body = oa.completion_response(view, model=info.get("model") or "", stops=stops,
                                          echo=info.get("echo"))
        return "output", {**base, "response": {"status_code": 200, "request_id": request_id, "body": body},
                          "error": None}
    if not view.status or view.status in (JobStatus.QUEUED, JobStatus.RUNNING):
        return "pending", {}
    failure = oa.job_failure(view)
    error = {"code": failure.code, "message": failure.message}
    body = openai_error_body(failure.status_code, failure.code, failure.message)
    return "errors", {**base, "response": {"status_code": failure.status_code, "request_id": request_id,
                                           "body": body}, "error": error}


def _output_lines(sessions: sessionmaker[Session], row: store.OpenAIBatch, kind: str) -> Iterator[bytes]:
    for seq, job in batch_service.iter_batch_jobs(sessions, batch_id=row.batch_id):
        which, line = _line(row, seq, job)
        if which == kind:
            yield (json.dumps(line, separators=(",", ":"), default=str) + "\n").encode()


def _routers() -> tuple[APIRouter, APIRouter, APIRouter]:
    routers = []
    for prefix in ("/v1/files", "/openai/v1/files"):
        router = APIRouter(prefix=prefix, tags=["openai"], include_in_schema=False,
                           route_class=json_input.LimitedJsonRoute)
        router.add_api_route("", upload_file, methods=["POST"])
        router.add_api_route("", list_files, methods=["GET"])
        router.add_api_route("/{file_id}", get_file, methods=["GET"])
        router.add_api_route("/{file_id}/content", file_content, methods=["GET"])
        router.add_api_route("/{file_id}", delete_file, methods=["DELETE"])
        routers.append(router)
    batches = APIRouter(prefix="/openai/v1/batches", tags=["openai"], include_in_schema=False,
                        route_class=json_input.LimitedJsonRoute)
    batches.add_api_route("", create_batch, methods=["POST"])
    batches.add_api_route("", list_batches, methods=["GET"])
    batches.add_api_route("/{batch_id}", get_batch, methods=["GET"])
    batches.add_api_route("/{batch_id}/cancel", cancel_batch, methods=["POST"])
    return routers[0], routers[1], batches


files_router, openai_files_router, batches_router = _routers()
FILE_PATHS = ("/v1/files", "/openai/v1/files")  # uploads: the batch body limit applies
