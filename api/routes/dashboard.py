"""The operator dashboard (``/dashboard``) and the admin JSON endpoints it reads.

The page itself is static HTML + one small script (``api/dashboard/``, no build step) and needs
no key to load; the script asks for an admin key (or trades the one-time code of the sign-in
link ``cloverq up`` prints for it: ``POST /dashboard/login``, ``api/dashboard_login.py``), keeps
it in ``sessionStorage`` and sends it as ``Authorization: Bearer`` to the admin-scoped JSON
endpoints below, which read SQL (the
system of record) and the workers' metric snapshots in Redis. Payloads (prompts, outputs) are
never returned here: operators see counts, timings, errors and the clients' own job and batch
``metadata`` (labels such as a contract id).
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Query
from fastapi.responses import FileResponse, HTMLResponse
from pydantic import BaseModel, Field
from sqlalchemy import func, select

from api.dashboard_login import redeem_login_code
from api.deps import AdminCaller, RedisDep, SessionDep, SettingsDep
from api.errors import ApiError
from api.schemas.errors import error_responses
from api.tenant_queues import tenant_rows
from api.version_compare import canaries, compare_versions
from scheduler.batches import service as batch_service
from scheduler.batches.service import Batch, BatchJob, BatchSummary
from scheduler.fleet import queue_drain
from scheduler.fleet.workers import list_workers
from scheduler.infra import redis_keys
from scheduler.jobs.models import Job, JobKind, JobStatus, QueueName
from scheduler.model_versions.registry import list_active
from scheduler.observability.metrics_recorder import read_version_invalid_retries, read_worker_snapshots

DASHBOARD_DIR = Path(__file__).resolve().parent.parent / "dashboard"
LATENCY_WINDOW = 500  # finished jobs used for latency percentiles and the charts
MAX_JOBS_PAGE = 200
MAX_BATCHES_PAGE = 100
# Tenant names as keys allow them; anything else (NUL bytes included) is a 422, not a SQL error.
TENANT_QUERY_PATTERN = r"^[A-Za-z0-9_.\-]{1,128}$"

# Admin JSON routes answer 401/403 (auth), 429 (rate limit) and 503 (database down) too.
router = APIRouter(tags=["dashboard"], responses=error_responses(401, 403, 429, 503))


@lru_cache(maxsize=1)
def _index_html() -> str:
    return (DASHBOARD_DIR / "index.html").read_text(encoding="utf-8")


@router.get("/dashboard", include_in_schema=False)
def dashboard_page() -> HTMLResponse:
    """The single-page dashboard (static; data comes from the admin endpoints)."""
    return HTMLResponse(_index_html(), headers={"Cache-Control": "no-store"})


@router.get("/dashboard/{asset}", include_in_schema=False)
def dashboard_asset(asset: str) -> FileResponse:
    """The page's script and stylesheet (a fixed allow-list, never a path from the client)."""
    allowed = {"app.js": "text/javascript", "style.css": "text/css"}
    if asset not in allowed:
        raise ApiError(404, "not_found", "No such asset.")
    return FileResponse(
        DASHBOARD_DIR / asset, media_type=allowed[asset], headers={"Cache-Control": "no-store"}
    )


class LoginCode(BaseModel):
    """The one-time code of a sign-in link (``api/dashboard_login.py``)."""

    code: str = Field(min_length=16, max_length=128, pattern=r"^[A-Za-z0-9_\-]+$")


@router.post("/dashboard/login", include_in_schema=False)
def dashboard_login(body: LoginCode, redis_client: RedisDep) -> dict[str, str]:
    """Trade a sign-in link's one-time code for the key it stands for (once)."""
    key = redeem_login_code(redis_client, body.code)
    if key is None:
        raise ApiError(401, "unauthorized", "This sign-in link was already used or has expired: sign "
                       "in with an admin key (cloverq up prints the dev key, and a new link when restarted).")
    return {"key": key}


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return max(0.0, (end - start).total_seconds())


def _job_row(job: Job) -> dict[str, Any]:
    """A job as the dashboard lists it: identity, state and timings; no payload."""
    return {
        "id": str(job.id),
        "tenant": job.tenant,
        "kind": job.kind,
        "status": job.status,
        "priority": job.priority,
        "queue": job.queue,
        "attempt": job.attempt,
        "max_attempts": job.max_attempts,
        "steps_used": job.steps_used,
        "step_budget": job.step_budget,
        "model_version": job.model_version,
        "worker_id": job.worker_id,
        "error_code": job.error_code,
        "created_at": _iso(job.created_at),
        "started_at": _iso(job.started_at),
        "finished_at": _iso(job.finished_at),
        "wait_seconds": _seconds(job.created_at, job.started_at),
        "run_seconds": _seconds(job.started_at, job.finished_at),
    }


def _percentiles(values: np.ndarray) -> dict[str, float | None]:
    if values.size == 0:
        return {"p50": None, "p95": None}
    p50, p95 = np.percentile(values, [50, 95])
    return {"p50": float(p50), "p95": float(p95)}


def _recent_finished(session: Any, limit: int) -> list[Job]:
    stmt = (
        select(Job)
        .where(Job.finished_at.is_not(None), Job.started_at.is_not(None))
        .order_by(Job.finished_at.desc())
        .limit(limit)
    )
    return list(session.scalars(stmt))


def _latency_points(jobs: list[Job]) -> list[dict[str, Any]]:
    return [
        {
            "id": str(job.id),
            "queue": job.queue,
            "kind": job.kind,
            "status": job.status,
            "finished_at": _iso(job.finished_at),
            "wait_seconds": _seconds(job.created_at, job.started_at),
            "run_seconds": _seconds(job.started_at, job.finished_at),
        }
        for job in jobs
    ]


def _latency_by_queue(points: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """p50/p95 wait and run time per queue over the recent window (vectorised per queue)."""
    if not points:
        return {}
    queues = np.asarray([p["queue"] for p in points])  # [N]
    waits = np.asarray([p["wait_seconds"] for p in points], dtype=np.float64)  # [N]
    runs = np.asarray([p["run_seconds"] for p in points], dtype=np.float64)  # [N]
    out: dict[str, dict[str, Any]] = {}
    for queue in sorted(set(queues.tolist())):  # a handful of queues
        sel = queues == queue
        out[queue] = {
            "n": int(sel.sum()),
            "wait": _percentiles(waits[sel]),
            "run": _percentiles(runs[sel]),
        }
    return out


def _workers(redis_client: Any) -> list[dict[str, Any]]:
    """Live workers: identity, state, queues and model version from the worker registry, joined
    with the throughput/memory figures of their metric snapshots (both refreshed every few s)."""
    snapshots = {snap["worker"]: snap for snap in read_worker_snapshots(redis_client)}
    workers = []
    for info in list_workers(redis_client):  # a handful of workers
        snap = snapshots.get(info.id, {})
        memory = {m["kind"]: m["bytes"] for m in snap.get("device_memory", [])}
        imbalance = list((snap.get("expert_imbalance") or {}).values())
        workers.append(
            {
                "worker": info.id,
                "hostname": info.hostname,
                "pid": info.pid,
                "state": info.state,
                "queues": list(info.queues),
                "model_name": snap.get("model_name"),
                "model_version": info.model_version or snap.get("model_version"),
                "model_load_seconds": snap.get("model_load_seconds"),
                "tokens_per_second": snap.get("tokens_per_second"),
                "batch_occupancy": snap.get("batch_occupancy"),
                "memory_used_bytes": memory.get("used"),
                "memory_total_bytes": memory.get("total"),
                "expert_imbalance_max": max(imbalance) if imbalance else None,
                "heartbeat_at": datetime.fromtimestamp(info.heartbeat_at, UTC).isoformat(),
            }
        )
    return workers


def _model_label(name: str | None, version: str | None) -> str:
    """``name@version`` without repeating a name the version already starts with."""
    if not version:
        return name or "?"
    if not name or version.startswith(f"{name}@"):
        return version
    return f"{name}@{version}"


@router.get("/v1/admin/overview")
def admin_overview(session: SessionDep, redis_client: RedisDep, _: AdminCaller) -> dict[str, Any]:
    """Everything the dashboard's top half and ``cloverq top`` show, in one round trip."""
    rows = session.execute(select(Job.queue, Job.status, func.count()).group_by(Job.queue, Job.status)).all()
    by_queue: dict[str, dict[str, int]] = {q.value: {s.value: 0 for s in JobStatus} for q in QueueName}
    by_status: dict[str, int] = {s.value: 0 for s in JobStatus}
    for queue, status, n in rows:  # one row per (queue, status) pair
        by_queue.setdefault(str(queue), {s.value: 0 for s in JobStatus})[str(status)] = int(n)
        by_status[str(status)] = by_status.get(str(status), 0) + int(n)
    since = datetime.now(UTC) - timedelta(minutes=1)
    finished_last_minute = session.scalar(
        select(func.count()).select_from(Job).where(Job.finished_at >= since)
    )
    recent = _recent_finished(session, LATENCY_WINDOW)
    points = _latency_points(recent)
    workers = _workers(redis_client)
    active = list_active(session)
    ready_by_queue: dict[str, int] = {q.value: 0 for q in QueueName}
    versions: dict[str, int] = {}
    for worker in workers:  # bookkeeping over a handful of workers
        if worker["state"] == "ready":
            for queue in worker["queues"]:
                ready_by_queue[queue] = ready_by_queue.get(queue, 0) + 1
        label = _model_label(worker["model_name"], worker["model_version"])
        versions[label] = versions.get(label, 0) + 1
    drained = queue_drain.drained_queues(redis_client)  # an operator's drain: no worker takes from it
    queues = [
        {
            "name": name,
            "queued": counts.get(JobStatus.QUEUED.value, 0),
            "running": counts.get(JobStatus.RUNNING.value, 0),
            "workers_ready": ready_by_queue.get(name, 0),
            "drained": name in drained,
        }
        for name, counts in by_queue.items()
    ]
    return {
        "generated_at": datetime.now(UTC).isoformat(),
        "counts": {"by_status": by_status, "by_queue": by_queue},
        "queues": queues,
        "workers": workers,
        "model_versions": versions,
        # Side by side per version (canary first) and the canaries in effect (api/version_compare.py).
        "versions": compare_versions(recent, workers, active=active,
                                     invalid_retries=read_version_invalid_retries(redis_client)),
        "canaries": canaries(active),
        "throughput": {
            "finished_last_minute": int(finished_last_minute or 0),
            "tokens_per_second": float(sum(w["tokens_per_second"] or 0.0 for w in workers)),
        },
        "latency": _latency_by_queue(points),
        # Per class and tenant: queued (held by fair share / listed), running, oldest wait, weight.
        "tenants": tenant_rows(session, redis_client),
    }


@router.get("/v1/admin/latency")
def admin_latency(
    session: SessionDep,
    _: AdminCaller,
    limit: Annotated[int, Query(ge=1, le=LATENCY_WINDOW)] = 200,
) -> dict[str, Any]:
    """Wait and run time of the most recently finished jobs (the dashboard's charts)."""
    points = _latency_points(_recent_finished(session, limit))
    return {"points": points, "by_queue": _latency_by_queue(points)}


@router.get("/v1/admin/jobs")
def admin_jobs(
    session: SessionDep,
    _: AdminCaller,
    status: Annotated[JobStatus | None, Query()] = None,
    queue: Annotated[QueueName | None, Query()] = None,
    kind: Annotated[JobKind | None, Query()] = None,
    tenant: Annotated[str | None, Query(max_length=128, pattern=TENANT_QUERY_PATTERN)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_JOBS_PAGE)] = 50,
) -> dict[str, Any]:
    """Most recent jobs across tenants, newest first, with optional filters."""
    stmt = select(Job).order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)
    if status is not None:
        stmt = stmt.where(Job.status == status.value)
    if queue is not None:
        stmt = stmt.where(Job.queue == queue.value)
    if kind is not None:
        stmt = stmt.where(Job.kind == kind.value)
    if tenant:
        stmt = stmt.where(Job.tenant == tenant)
    return {"items": [_job_row(job) for job in session.scalars(stmt)]}


def _timeline(job: Job) -> list[dict[str, Any]]:
    events: list[tuple[str, datetime | None]] = [
        ("created", job.created_at),
        ("available", job.available_at if _later(job.available_at, job.created_at) else None),
        ("started", job.started_at),
        ("finished", job.finished_at),
        ("expires", job.expires_at),
    ]
    return [{"event": name, "at": _iso(at)} for name, at in events if at is not None]


def _later(at: datetime | None, than: datetime | None, *, slack_seconds: float = 1.0) -> bool:
    """Whether ``at`` is meaningfully after ``than`` (a retry backoff or an aging move)."""
    return at is not None and than is not None and (at - than).total_seconds() > slack_seconds


def _hot_progress(redis_client: Any, job_id: uuid.UUID) -> dict[str, Any] | None:
    raw = redis_client.get(redis_keys.progress(job_id))
    if raw is None:
        return None
    progress = json.loads(raw)
    if isinstance(progress, dict):
        return _without_payload(progress)
    return None


@router.get("/v1/admin/jobs/{job_id}", responses=error_responses(404))
def admin_job_detail(
    job_id: str, session: SessionDep, redis_client: RedisDep, settings: SettingsDep, _: AdminCaller
) -> dict[str, Any]:
    """One job for the detail pane: timeline, steps, progress, error (no prompt, no output)."""
    try:
        parsed = uuid.UUID(job_id)
    except ValueError:
        parsed = None
    job = session.get(Job, parsed) if parsed is not None else None
    if job is None:
        raise ApiError(404, "job_not_found", f"No job with id '{job_id}'.")
    result = job.result or {}
    detail = _job_row(job)
    detail.update(
        {
            "timeline": _timeline(job),
            "params": job.params,
            "request_id": job.request_id,
            "cancel_requested": job.cancel_requested,
            "error_message": job.error_message,
            "progress": _with_prefill(
                job, _hot_progress(redis_client, job.id) or _without_payload(job.progress)),
            "finish_reason": result.get("finish_reason"),
            "usage": result.get("usage"),
            # The client's own labels (a contract id, a document name): what lets an operator
            # find the job a pipeline asks about. Not a payload (no prompt, no output).
            "metadata": job.meta,
            "batch_id": str(job.batch_id) if job.batch_id is not None else None,
            # The job's OpenTelemetry trace (docs/observability.md) and, with tracing_ui_url, a link.
            "trace_id": job.trace_id,
            "trace_url": _trace_url(settings.observability.tracing_ui_url, job.trace_id),
        }
    )
    return detail


def _trace_url(template: str | None, trace_id: str | None) -> str | None:
    """The operator's trace UI page of ``trace_id`` (a 32-hex id: nothing to escape)."""
    if template is None or trace_id is None:
        return None
    return template.replace("{trace_id}", trace_id)


def _with_prefill(job: Job, progress: dict[str, Any] | None) -> dict[str, Any] | None:
    """Progress with its prefill figures (``prompt_tokens_done`` of ``prompt_tokens``): a finished
    job's come from its usage, and a succeeded job prefilled its whole prompt (as ``GET /v1/jobs``
    shows it, api/presenters.py)."""
    merged = dict(progress or {})
    usage = (job.result or {}).get("usage") or {}
    if merged.get("prompt_tokens") is None and isinstance(usage.get("prompt_tokens"), int):
        merged["prompt_tokens"] = usage["prompt_tokens"]
    if job.status == JobStatus.SUCCEEDED and merged.get("prompt_tokens") is not None:
        merged["prompt_tokens_done"] = merged["prompt_tokens"]
    return merged or None


def _batch_row(summary: BatchSummary) -> dict[str, Any]:
    """A batch as the dashboard lists it: the fields of ``GET /v1/batches/{id}`` plus its tenant."""
    batch = summary.batch
    return {
        "id": str(batch.id),
        "tenant": batch.tenant,
        "status": summary.status.value,
        "total": batch.total,
        "finished": summary.finished,
        "counts": summary.counts,
        "created_at": _iso(batch.created_at),
        "cancel_requested": batch.cancel_requested,
        "metadata": batch.meta,
    }


@router.get("/v1/admin/batches")
def admin_batches(
    session: SessionDep,
    _: AdminCaller,
    tenant: Annotated[str | None, Query(max_length=128, pattern=TENANT_QUERY_PATTERN)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_BATCHES_PAGE)] = 20,
) -> dict[str, Any]:
    """Most recent batches across tenants, newest first, with their job counts by status (one
    GROUP BY over the page's jobs; ``GET /v1/batches/{id}`` answers the same for one batch)."""
    stmt = select(Batch).order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit)
    if tenant:
        stmt = stmt.where(Batch.tenant == tenant)
    batches = list(session.scalars(stmt))
    counts: dict[uuid.UUID, dict[str, int]] = {batch.id: {} for batch in batches}
    if batches:
        rows = session.execute(
            select(Job.batch_id, Job.status, func.count())
            .where(Job.batch_id.in_(list(counts)))
            .group_by(Job.batch_id, Job.status)
        ).all()
        for batch_id, status, n in rows:  # one row per (batch, status) pair
            if batch_id is not None:
                counts[batch_id][str(status)] = int(n)
    return {"items": [_batch_row(BatchSummary(batch=b, counts=counts[b.id])) for b in batches]}


@router.get("/v1/admin/batches/{batch_id}", responses=error_responses(404))
def admin_batch_detail(
    batch_id: str,
    session: SessionDep,
    _: AdminCaller,
    limit: Annotated[int, Query(ge=1, le=MAX_JOBS_PAGE)] = 100,
) -> dict[str, Any]:
    """One batch and its first ``limit`` jobs in submission order (identity, state, timings and
    metadata; no prompt, no output: ``GET /v1/batches/{id}/results`` is the client's route)."""
    batch = batch_service.get_batch(session, batch_id=batch_id, tenant=None)
    if batch is None:
        raise ApiError(404, "batch_not_found", f"No batch with id '{batch_id}'.", {"batch_id": batch_id})
    stmt = (
        select(BatchJob.seq, Job)
        .join(Job, Job.id == BatchJob.job_id)
        .where(BatchJob.batch_id == batch.id)
        .order_by(BatchJob.seq)
        .limit(limit)
    )
    jobs = [{"index": seq, **_job_row(job), "metadata": job.meta} for seq, job in session.execute(stmt).all()]
    return {**_batch_row(batch_service.summarize(session, batch)), "jobs": jobs}


def _without_payload(progress: dict[str, Any] | None) -> dict[str, Any] | None:
    if progress is None:
        return None
    return {k: v for k, v in progress.items() if k not in _PAYLOAD_PROGRESS_KEYS}


# Progress fields that carry generated content: operators see counts, not text.
_PAYLOAD_PROGRESS_KEYS = frozenset({"partial_text", "committed_token_ids", "text", "token_ids"})
