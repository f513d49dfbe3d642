"""Job rows (SQL) and hot progress (Redis) turned into the API's response models."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from api.schemas.jobs import JobErrorInfo, JobOut, JobProgress, JobResult, JobTimings
from scheduler.jobs.models import Job, JobStatus

_PROGRESS_FIELDS = tuple(JobProgress.model_fields)
_RESULT_FIELDS = tuple(JobResult.model_fields)


def _ms(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start).total_seconds() * 1000.0, 3)


def _progress(job: Job, hot: Mapping[str, Any] | None) -> JobProgress | None:
    """Redis hot status wins over the coarser SQL snapshot while the job runs (the attempt's own
    status only: a retry starts from zero); a finished job shows its outcome's figures, which are
    never below what it showed while running (the last blocks can finish after the last report)."""
    merged: dict[str, Any] = {}
    if job.progress:
        merged.update(job.progress)
    if hot and job.status == JobStatus.RUNNING and hot.get("attempt", job.attempt) == job.attempt:
        merged.update(hot)
    usage = (job.result or {}).get("usage") or {}
    if usage and JobStatus(job.status).is_final:
        for name, figure in (("blocks_done", usage.get("blocks")),
                             ("tokens_committed", usage.get("completion_tokens")),
                             ("steps_used", usage.get("steps_used"))):
            if isinstance(figure, int):
                merged[name] = max(figure, merged.get(name) or 0)
    if JobStatus(job.status).is_final and job.steps_used:
        merged["steps_used"] = max(job.steps_used, merged.get("steps_used") or 0)
    if job.status == JobStatus.SUCCEEDED and merged.get("blocks_done"):
        merged["blocks_total"] = merged["blocks_done"]  # what it needed (EOS can come early)
    if job.status == JobStatus.SUCCEEDED and merged.get("prompt_tokens") is not None:
        merged["prompt_tokens_done"] = merged["prompt_tokens"]  # a succeeded job prefilled it all
    merged.setdefault("steps_used", job.steps_used)
    merged.setdefault("step_budget", job.step_budget)
    if not merged:
        return None
    return JobProgress(**{name: merged.get(name) for name in _PROGRESS_FIELDS})


def _engine_ms(result: Mapping[str, Any] | None) -> dict[str, float | None]:
    """Engine-side time of the outcome (the worker stores seconds under ``result.timings``)."""
    timings = (result or {}).get("timings") or {}

    def ms(key: str) -> float | None:
        value = timings.get(key)
        return round(float(value) * 1000.0, 3) if isinstance(value, (int, float)) else None

    return {"engine_queue_ms": ms("engine_queue_seconds"), "engine_run_ms": ms("engine_run_seconds")}


def job_out(job: Job, hot_progress: Mapping[str, Any] | None = None) -> JobOut:
    """The public view of ``job``; the input and internal bookkeeping are not echoed."""
    # A purged job's SQL result keeps only its figures (scheduler/maintenance/data_purge.py): no result.
    shown = job.result if job.result and job.purged_at is None else None
    result = JobResult(**{name: shown.get(name) for name in _RESULT_FIELDS}) if shown else None
    error = (
        JobErrorInfo(code=job.error_code, message=job.error_message)
        if job.error_code or job.error_message
        else None
    )
    timings = JobTimings(
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        expires_at=job.expires_at,
        queued_ms=_ms(job.created_at, job.started_at),
        run_ms=_ms(job.started_at, job.finished_at),
        total_ms=_ms(job.created_at, job.finished_at),
        **_engine_ms(job.result),
    )
    return JobOut(
        id=str(job.id),
        kind=job.kind,
        status=job.status,
        queue=job.queue,
        priority=job.priority,
        tenant=job.tenant,
        attempt=job.attempt,
        max_attempts=job.max_attempts,
        model_version=job.model_version,
        routed_version=job.routed_version,
        params=job.params,
        metadata=job.meta,
        progress=_progress(job, hot_progress),
        result=result,
        error=error,
        timings=timings,
        cancel_requested=job.cancel_requested,
        trace_id=job.trace_id,
        scheduled_for=job.scheduled_for,
        webhook_events=job.webhook_events.split() if job.webhook_events is not None else None,
        retention_seconds=job.retention_seconds,
        purged_at=job.purged_at,
        usage=(job.result or {}).get("usage") or None,
    )
