"""Purging finished jobs' data everywhere cloverq stored it, leaving a tombstone row.

Contract texts are confidential (docs/security.md#retention): once a job's retention passed
(``scheduler/maintenance/retention_tick.py``) or its tenant asked (``DELETE /v1/jobs/{id}/data``,
``DELETE /v1/batches/{id}/data``), :func:`purge_jobs` removes its text from every place that held
it:

- SQL, ``jobs``: ``input`` and ``error_message`` (a worker's message may quote the input) become
  NULL; ``result`` keeps only its figures (``usage``, ``finish_reason``, engine ``timings``, a
  decision's ``mode``), never text or token ids; ``progress`` keeps only its counters. Left: the
  tombstone (id, tenant, kind, status, timings, attempts, usage, metadata labels, ``purged_at``).
- SQL, ``webhook_deliveries``: every delivery of the job (``job.started``, ``job.progress``,
  ``job.finished``, sent or pending) keeps only the job's id, status, labels and times; a pending
  one then delivers that tombstone.
- SQL, ``openai_batches`` / ``openai_files``: the OpenAI batch made from the job's batch forgets
  its lines' stop sequences and echoed prompts, and its input file (the JSONL that holds the
  prompts) is emptied. The file holds every line of the batch, so it goes with the first job of
  the batch purged.
- Redis: the job's hot status (``partial_text``), its event stream (every committed block's text)
  and its cancel key (``scheduler/infra/redis_keys.py``).

SQL first, committed, then Redis (the system of record says "purged" before the transport
forgets). Every step is idempotent: purging twice changes nothing the first did not. Only final
jobs are purged (a queued or running job's input is still needed). Nothing here logs text.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import redis
import structlog
from sqlalchemy import bindparam, null, select, update
from sqlalchemy.orm import Session

from scheduler.batches.openai_batches import OpenAIBatch, OpenAIFile
from scheduler.infra import redis_keys
from scheduler.infra.settings import Settings
from scheduler.jobs.models import FINAL_STATUSES, Job
from scheduler.webhooks.tables import WebhookDelivery

log = structlog.get_logger(__name__)

# The worker writes a job's last stream events, hot status and webhook outbox row just after its
# final SQL write; a purge this soon after it (a DELETE right at the finish) sweeps again later.
SETTLE_SECONDS = 5.0


def settle_seconds(settings: Settings) -> float:
    """How long after a job's finish (or a purge on request) its data is swept (again): the worker's
    last writes land just after the final SQL write (``SETTLE_SECONDS``), and a worker whose lease
    expired while it still ran (the reaper made the job final) keeps writing stream events and hot
    status until its next renewal tells it so, at most one lease later."""
    return settings.jobs.lease_seconds + SETTLE_SECONDS

FINAL = tuple(status.value for status in FINAL_STATUSES)
RESULT_FIGURES = ("usage", "timings")  # dicts of numbers, kept (numbers only)
RESULT_LABELS = ("finish_reason", "mode")  # short enum strings, kept
WEBHOOK_JOB_KEYS = ("id", "kind", "status", "attempt", "batch_id", "metadata", "started_at", "finished_at")
OPENAI_REQUEST_KEYS = ("custom_id", "model")  # what an OpenAI batch's line keeps (no stop, no echo)


@dataclass(frozen=True, slots=True)
class PurgeResult:
    """What one purge did: ``jobs`` tombstoned (final jobs among those asked), webhook
    ``deliveries`` and ``openai_batches`` scrubbed, whether Redis was cleaned (``redis_ok``)."""

    jobs: list[uuid.UUID]
    deliveries: int
    openai_batches: int
    redis_ok: bool


def _numbers(value: Any) -> dict[str, Any]:
    """The numeric entries of a dict (counters, seconds); anything else is dropped."""
    if not isinstance(value, Mapping):
        return {}
    return {key: number for key, number in value.items()
            if isinstance(number, int | float) and not isinstance(number, bool)}


def tombstone_result(result: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What a purged job's ``result`` keeps: its figures, never text (None when nothing is left)."""
    if not result:
        return None
    kept: dict[str, Any] = {key: _numbers(result[key]) for key in RESULT_FIGURES if result.get(key)}
    kept.update({key: result[key] for key in RESULT_LABELS if isinstance(result.get(key), str)})
    return kept or None


def tombstone_progress(progress: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What a purged job's SQL ``progress`` keeps: its counters."""
    return _numbers(progress) or None


def tombstone_payload(payload: Mapping[str, Any], purged_at: datetime) -> dict[str, Any]:
    """A webhook body without the job's data: its event, the job's id, status, labels and times,
    and ``data_purged``. A whitelist, so a field added to payloads later is dropped too."""
    given = payload.get("job")
    job: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
    kept: dict[str, Any] = {key: job[key] for key in WEBHOOK_JOB_KEYS if key in job}
    if "progress" in job:
        kept["progress"] = _numbers(job["progress"])
    if "result" in job:
        kept["result"] = None
    error = job.get("error")
    if isinstance(error, Mapping):
        kept["error"] = {"code": error.get("code"), "message": None}
    kept.update(data_purged=True, purged_at=purged_at.isoformat())
    return {"event": payload.get("event"), "job": kept}


def is_tombstone(payload: Mapping[str, Any]) -> bool:
    job = payload.get("job")
    return isinstance(job, Mapping) and job.get("data_purged") is True


def purge_jobs(
    session: Session, redis_client: redis.Redis, job_ids: Iterable[uuid.UUID], *, now: datetime,
    sweep_again_at: datetime | None = None,
) -> PurgeResult:
    """Purge the data of the final jobs among ``job_ids`` (others are left alone) in SQL
    (committed here), then in Redis. Their ``purge_at`` becomes ``sweep_again_at`` (None: no
    purge scheduled any more), or, when Redis failed, a retry by the purge tick."""
    ids = list(dict.fromkeys(job_ids))
    if not ids:
        return PurgeResult(jobs=[], deliveries=0, openai_batches=0, redis_ok=True)
    purged, batch_ids = _scrub_jobs(session, ids, now=now)
    deliveries = _scrub_deliveries(session, purged, now=now)
    openai = _scrub_openai_batches(session, batch_ids)
    session.commit()
    redis_ok = True
    try:
        drop_redis_data(redis_client, purged)
    except redis.RedisError as exc:  # SQL holds the tombstone; the purge tick cleans Redis later
        redis_ok = False
        log.warning("retention.redis_purge_failed", jobs=len(purged), error=type(exc).__name__)
    next_at = sweep_again_at if redis_ok else now + timedelta(seconds=SETTLE_SECONDS)
    if purged:
        session.execute(update(Job).where(Job.id.in_(purged)).values(purge_at=next_at))
        session.commit()
    return PurgeResult(jobs=purged, deliveries=deliveries, openai_batches=openai, redis_ok=redis_ok)


def _scrub_jobs(session: Session, ids: Sequence[uuid.UUID], *, now: datetime) -> tuple[
    list[uuid.UUID], set[uuid.UUID]
]:
    """Tombstone the final jobs among ``ids``; returns their ids and their batches' ids."""
    rows = session.execute(
        select(Job.id, Job.result, Job.progress, Job.batch_id)
        .where(Job.id.in_(ids), Job.status.in_(FINAL))
    ).all()
    if not rows:
        return [], set()
    purged = [row.id for row in rows]
    # SQL NULL (null()), never JSON null, for what goes; then the figures kept, row by row.
    session.execute(
        update(Job).where(Job.id.in_(purged), Job.status.in_(FINAL))
        .values(input=null(), result=null(), progress=null(), error_message=None, updated_at=now)
    )
    session.execute(update(Job).where(Job.id.in_(purged), Job.purged_at.is_(None)).values(purged_at=now))
    for column, tombstone in (("result", tombstone_result), ("progress", tombstone_progress)):
        kept = [{"b_id": row.id, "b_value": value} for row in rows
                if (value := tombstone(getattr(row, column))) is not None]
        _update_each(session, Job.__table__, column, kept)
    return purged, {row.batch_id for row in rows if row.batch_id is not None}


def _update_each(session: Session, table: Any, column: str, values: list[dict[str, Any]]) -> None:
    """One executemany ``UPDATE table SET column = b_value WHERE id = b_id`` (Core: one value per row)."""
    if values:
        session.connection().execute(
            update(table).where(table.c.id == bindparam("b_id"))
            .values({column: bindparam("b_value", type_=table.c[column].type)}),
            values,
        )


def _scrub_deliveries(session: Session, job_ids: Sequence[uuid.UUID], *, now: datetime) -> int:
    """Every webhook body of the jobs -> its tombstone (sent ones too: the outbox keeps them)."""
    if not job_ids:
        return 0
    rows = session.execute(
        select(WebhookDelivery.id, WebhookDelivery.payload).where(WebhookDelivery.job_id.in_(job_ids))
    ).all()
    changed = [{"b_id": row.id, "b_value": tombstone_payload(row.payload or {}, now)}
               for row in rows if not is_tombstone(row.payload or {})]
    _update_each(session, WebhookDelivery.__table__, "payload", changed)
    return len(changed)


def _scrub_openai_batches(session: Session, batch_ids: set[uuid.UUID]) -> int:
    """The OpenAI batches of these cloverq batches whose jobs are all purged: their lines' stop
    sequences and echoed prompts go, and their input files are emptied (they hold every line's
    prompt)."""
    if not batch_ids:
        return 0
    # Only once every job of the batch is purged: the lines' stop and echo still shape the output
    # file of the jobs that run or wait, and the input file serves them all.
    unpurged = set(session.scalars(select(Job.batch_id).where(Job.batch_id.in_(batch_ids),
                                                              Job.purged_at.is_(None)).distinct()))
    batch_ids = set(batch_ids) - unpurged
    if not batch_ids:
        return 0
    rows = list(session.scalars(select(OpenAIBatch).where(OpenAIBatch.batch_id.in_(batch_ids))))
    for row in rows:
        if any(set(line) - set(OPENAI_REQUEST_KEYS) for line in row.requests):
            row.requests = [{key: line.get(key) for key in OPENAI_REQUEST_KEYS} for line in row.requests]
    files = {row.input_file_id for row in rows}
    if files:  # an UPDATE, never a load of the file's bytes
        session.execute(update(OpenAIFile).where(OpenAIFile.id.in_(files), OpenAIFile.bytes > 0)
                        .values(content=b"", bytes=0))
    session.flush()
    return len(rows)


def drop_redis_data(client: redis.Redis, job_ids: Sequence[uuid.UUID]) -> int:
    """Delete the jobs' hot status, event streams and cancel keys (one pipeline); how many
    existed. Raises ``redis.RedisError``."""
    if not job_ids:
        return 0
    with client.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.delete(redis_keys.progress(job_id), redis_keys.events(job_id), redis_keys.cancel(job_id))
        return sum(int(count) for count in pipe.execute())
