"""Helpers of the retention tests: leave a job's text where a worker would, and look for it
everywhere cloverq stores anything (every SQL table of the models, every Redis key)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import redis as redis_lib
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from scheduler.infra import redis_keys
from scheduler.jobs import event_stream
from scheduler.jobs.models import Base, Job, JobStatus, utcnow
from scheduler.webhooks.outbox import record_job_finished


def finish_like_a_worker(sessions: sessionmaker[Session], client: redis_lib.Redis, job_id: str | uuid.UUID,
                         text: str, *, failed: bool = False) -> None:
    """What a worker leaves when it finishes a job: the final row (result text, or an error message
    that quotes the input), its hot status, its event stream, a cancel key and the webhook outbox."""
    now = utcnow()
    parsed = uuid.UUID(str(job_id))
    result = {"text": text, "token_ids": [5, 6, 7], "finish_reason": "eos",
              "usage": {"prompt_tokens": 9, "completion_tokens": 3, "steps_used": 4, "blocks": 2},
              "timings": {"engine_queue_seconds": 0.01, "engine_run_seconds": 0.2}}
    values: dict[str, Any] = {
        "status": JobStatus.FAILED.value if failed else JobStatus.SUCCEEDED.value, "attempt": 1,
        "started_at": now - timedelta(seconds=1), "finished_at": now, "updated_at": now, "steps_used": 4,
        "progress": {"blocks_done": 2, "tokens_committed": 3},
        "expires_at": now + timedelta(days=7),
    }
    if failed:
        values.update(error_code="invalid_input", error_message=f"cannot parse {text!r}")
    else:
        values["result"] = result
    with sessions() as session:
        session.execute(update(Job).where(Job.id == parsed).values(**values))
        session.commit()
        job = session.get(Job, parsed)
        assert job is not None
        if job.webhook_url or job.batch_id:
            record_job_finished(session, job=job)
            session.commit()
    hot = {"status": "running", "attempt": 1, "blocks_done": 2, "partial_text": text}
    with client.pipeline() as pipe:
        pipe.set(redis_keys.progress(parsed), json.dumps(hot))
        pipe.set(redis_keys.cancel(parsed), "1")
        event_stream.add_events(pipe, parsed, [
            event_stream.status_event("running", 1),
            {"type": "block", "attempt": 1, "blocks_done": 1, "offset": 0, "delta": text},
            {"type": "block", "attempt": 1, "blocks_done": 2, "offset": len(text), "delta": "."},
            event_stream.status_event("succeeded", 1),
        ])
        pipe.execute()


def _text_of(value: Any) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "replace")
    return json.dumps(value, default=str, ensure_ascii=False)


def sql_holding(sessions: sessionmaker[Session], text: str) -> list[str]:
    """``table.column`` of every SQL value (any table of the models) that contains ``text``."""
    found = []
    with sessions() as session:
        for table in Base.metadata.sorted_tables:
            for row in session.execute(select(table)).mappings():
                found += [f"{table.name}.{name}" for name, value in row.items() if text in _text_of(value)]
    return found


def redis_holding(client: redis_lib.Redis, text: str) -> list[str]:
    """Every Redis key (SCAN over the whole database) whose name or value contains ``text``."""
    found = []
    for key in client.scan_iter(count=500):
        name = key.decode() if isinstance(key, bytes) else str(key)
        value = _value(client, key)
        if text in name or text in repr(value) or text in _text_of(_decoded(value)):
            found.append(name)
    return found


def _value(client: redis_lib.Redis, key: Any) -> Any:
    """A key's whole value, whatever its type."""
    kind = client.type(key)
    kind = kind.decode() if isinstance(kind, bytes) else kind
    readers: dict[str, Callable[[], Any]] = {
        "string": lambda: client.get(key), "list": lambda: client.lrange(key, 0, -1),
        "set": lambda: client.smembers(key), "zset": lambda: client.zrange(key, 0, -1),
        "hash": lambda: client.hgetall(key), "stream": lambda: client.xrange(key),
    }
    return readers[kind]() if kind in readers else None


def keys_named_after(client: redis_lib.Redis, job_id: str | uuid.UUID) -> set[str]:
    """The Redis keys whose name holds the job's id (SCAN)."""
    return {key.decode() if isinstance(key, bytes) else str(key)
            for key in client.scan_iter(match=f"*{job_id}*", count=500)}


def _decoded(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {_decoded(k): _decoded(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_decoded(item) for item in value]
    return value
