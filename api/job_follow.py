"""Reading and following one job from the API: its status, and its status changes and committed
blocks as they happen.

:class:`JobReader` is the one read of a job (``read``: SQL plus the hot status) and the one wait
for it (``wait``: until it is final, or a deadline, woken by the jobs-finished notice), for
``GET /v1/jobs/{id}`` (``api/routes/jobs.py``, with and without ``wait``), ``GET
/v1/jobs/{id}/events`` (``api/routes/job_events.py``) and the OpenAI-compatible routes
(``api/routes/openai.py``: ``stream: true`` and the blocking answer); routes get it as
``api.deps.JobReaderDep``. :func:`follow_job` follows a job from two sources, one truth:

- **SQL** (with the hot status, exactly what ``GET /v1/jobs/{id}`` shows) decides the status,
  the attempt and the result. It is re-read when the job's event stream says an attempt began
  or ended, when the jobs-finished notice arrives (``api/job_waiter.py``), and otherwise on a
  doubling interval (so a final status written by the beat, which publishes nothing, is seen).
- **The job's event stream** (``scheduler/jobs/event_stream.py``, written by the worker's monitor)
  brings each committed block as it happens. It is read with ``XREAD BLOCK`` from where the
  reader left off (``after``: a stream entry id, e.g. SSE's ``Last-Event-ID``), so a reader that
  reconnects resumes; without a stream (expired, Redis flushed) the hot status stands in for it.

Nothing here holds a database connection or a thread while it waits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aioredis
import structlog
from fastapi import FastAPI
from redis import Redis, RedisError
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from api.drain import ApiDrain
from api.job_waiter import HEALTH_CHECK_SECONDS, MAX_RECHECK_SECONDS, RECHECK_SECONDS, JobWaiter
from api.presenters import job_out
from api.schemas.jobs import JobOut
from scheduler.infra import redis_keys
from scheduler.infra.redis_client import async_redis_from_url
from scheduler.infra.settings import Settings
from scheduler.jobs import event_stream
from scheduler.jobs import service as job_service
from scheduler.jobs.models import JobStatus

log = structlog.get_logger(__name__)

STREAM_BLOCK_MS = 1000  # one XREAD waits at most this long (then SQL may be re-read)
STREAM_BATCH = 256  # entries per XREAD
KEEPALIVE_SECONDS = 10.0  # an SSE comment this often while nothing happens (proxies, disconnects)
STREAM_MAX_CONNECTIONS = 1024  # XREAD BLOCK holds a connection per following request
WAITER_MAX_CONNECTIONS = 2  # the job waiter's subscription (and a resubscribe while the old one closes)


@dataclass
class Followed:
    """One thing that happened to the followed job.

    ``status``: the job as SQL shows it now (first, then on each status or attempt change);
    ``block``: a committed block (``event`` is the stream's ``block`` document, ``entry_id``
    its stream id); ``final``: the job is final (``job`` is the last read; nothing follows);
    ``keepalive``: nothing happened for a while."""

    kind: Literal["status", "block", "final", "keepalive"]
    job: JobOut | None = None
    event: dict[str, Any] | None = None
    entry_id: str | None = None


def _async_redis(app: FastAPI, attribute: str, max_connections: int) -> aioredis.Redis:
    client = getattr(app.state, attribute, None)
    if client is None:
        client = async_redis_from_url(  # redis+sentinel:// too: it then follows the master
            app.state.settings.resolved_redis_url, decode_responses=True, socket_connect_timeout=1.0,
            max_connections=max_connections, health_check_interval=HEALTH_CHECK_SECONDS,
        )
        setattr(app.state, attribute, client)
    return client


def stream_redis(app: FastAPI) -> aioredis.Redis:
    """The event streams' asyncio Redis client (created in the running event loop) for their
    ``XREAD BLOCK``. Separate from the process' sync client (``scheduler.infra.redis_client.get_redis``)
    because asyncio connections belong to their event loop, and because these reads block on
    purpose: no socket timeout."""
    return _async_redis(app, "stream_redis", STREAM_MAX_CONNECTIONS)


def waiter_redis(app: FastAPI) -> aioredis.Redis:
    """The job waiter's own asyncio client (``api/job_waiter.py``): its one subscription must never
    wait for (or be refused by) a pool that every following request may have filled."""
    return _async_redis(app, "waiter_redis", WAITER_MAX_CONNECTIONS)


async def close_stream_redis(app: FastAPI) -> None:
    """Close the asyncio clients (the streams' and the waiter's)."""
    for attribute in ("stream_redis", "waiter_redis"):
        client = getattr(app.state, attribute, None)
        if client is not None:
            setattr(app.state, attribute, None)
            with suppress(Exception):
                await client.aclose()


def is_final(job: JobOut) -> bool:
    return JobStatus(job.status).is_final


@dataclass(frozen=True, slots=True)
class JobReader:
    """One job as the API reads it and waits for it, from what the app set up (``api.deps``
    ``JobReaderDep`` builds one per request). ``read`` and ``cancel`` block (call them in the
    thread pool); ``wait`` holds no database connection or thread while it waits."""

    sessions: sessionmaker[Session]
    redis: Redis  # the process' sync client: the hot status, cancel signals
    waiter: JobWaiter  # the jobs-finished notices
    drain: ApiDrain  # this replica's drain (api/drain.py)
    settings: Settings
    streams: Callable[[], aioredis.Redis]  # the event streams' asyncio client (``stream_redis``)

    def read(self, job_id: str, tenant: str | None) -> JobOut | None:
        """The job as ``GET /v1/jobs/{id}`` shows it (SQL plus the hot status while it runs)."""
        with self.sessions() as session:
            job = job_service.get_job(session, job_id=job_id, tenant=tenant)
            if job is None:
                return None
            hot = None
            if job.status == JobStatus.RUNNING:
                try:
                    hot = job_service.read_progress(job.id, redis_client=self.redis)
                except RedisError:  # hot status is a nicety: fall back to the SQL snapshot
                    hot = None
            return job_out(job, hot_progress=hot)

    def cancel(self, job_id: str, tenant: str | None) -> None:
        """Cancel the job (a client that went away no longer wants it); never raises."""
        try:
            with self.sessions() as session:
                job_service.cancel_job(session, job_id=job_id, tenant=tenant, settings=self.settings,
                                       redis_client=self.redis)
            log.info("job.cancelled_on_disconnect", job_id=job_id)
        except Exception as exc:  # the client is gone: nobody to tell; the job runs to its end
            log.warning("job.cancel_on_disconnect_failed", job_id=job_id, error=type(exc).__name__)

    async def wait(self, job_id: str, tenant: str | None, *, deadline: float | None = None) -> JobOut | None:
        """The job once it is final (None if it is not there or disappears), woken by the
        jobs-finished notice and re-checked on a doubling interval (notices are the fast path).

        ``deadline`` (``time.monotonic()``; the long poll's): the job as it is then if it is not
        final by that time, or by the end of this replica's drain when that comes first. None:
        wait until it is final."""
        recheck = RECHECK_SECONDS
        async with self.waiter.watch(job_id) as finished:
            while True:
                finished.clear()  # before the read: a notice arriving during it wakes the next wait
                job = await run_in_threadpool(self.read, job_id, tenant)
                if job is None or is_final(job):
                    return job
                timeout = recheck
                if deadline is not None:
                    remaining = self.drain.cap(deadline) - time.monotonic()
                    if remaining <= 0:
                        return job
                    timeout = min(remaining, recheck)
                with suppress(TimeoutError):
                    await asyncio.wait_for(finished.wait(), timeout)
                recheck = min(2 * recheck, MAX_RECHECK_SECONDS)


def _hot_block(job: JobOut) -> dict[str, Any] | None:
    """A ``block`` event made from the hot status, for a running job whose stream is gone."""
    progress = job.progress
    if progress is None or not progress.partial_text:
        return None
    return {"type": "block", "attempt": job.attempt, "blocks_done": progress.blocks_done,
            "blocks_total": progress.blocks_total, "steps_used": progress.steps_used,
            "step_budget": progress.step_budget, "tokens_committed": progress.tokens_committed,
            "offset": 0, "delta": progress.partial_text, "from_hot_status": True}


def rebuilt(text: str, offset: Any, delta: Any) -> str:
    """``text`` after one block event's delta (``text[:offset] + delta``; a retry starts at 0)."""
    if isinstance(offset, int) and isinstance(delta, str):
        return text[: max(0, offset)] + delta
    return text


def completion(text: str, final: str) -> tuple[int, str] | None:
    """The ``(offset, delta)`` that turns the text the deltas built into the stored ``final`` text
    (what the stream did not carry: blocks a reader missed, the last bytes the worker's decoder
    held back); None when they already agree."""
    if text == final:
        return None
    common = 0
    for mine, theirs in zip(text, final, strict=False):
        if mine != theirs:
            break
        common += 1
    return common, final[common:]


def _block_ms(drain: ApiDrain | None) -> int:
    """How long the next ``XREAD`` may block: ``STREAM_BLOCK_MS``, less once a drain has begun
    (up to its deadline; 0 when it has passed)."""
    if drain is None or drain.deadline is None:
        return STREAM_BLOCK_MS
    return min(STREAM_BLOCK_MS, int(drain.seconds_left() * 1000))


def _stream_entries(answer: Any) -> list[tuple[str, dict[str, Any]]]:
    """The entries of a one-stream ``XREAD`` answer, ``[[key, entries]]`` on our RESP2 clients
    (redis-py types the answer as a union with RESP3's ``{key: entries}``)."""
    return event_stream.parse_entries(answer[0][1]) if answer else []


async def _replay(client: aioredis.Redis, key: str, cursor: str) -> AsyncIterator[Followed]:
    """Every ``block`` event the stream holds after ``cursor``, without waiting."""
    while True:
        try:
            answer = await client.xread({key: cursor}, count=STREAM_BATCH)
        except (RedisError, OSError):
            return
        entries = _stream_entries(answer)
        if not entries:
            return
        for entry_id, event in entries:
            cursor = entry_id
            if event.get("type") == "block":
                yield Followed("block", event=event, entry_id=entry_id)


async def follow_job(
    reader: JobReader, job_id: str, tenant: str | None, *, after: str | None = None,
    first: JobOut | None = None, keepalive_seconds: float = KEEPALIVE_SECONDS, drain: ApiDrain | None = None,
) -> AsyncGenerator[Followed, None]:
    """What happens to ``job_id`` from now on: ``status`` first, ``block`` events as the worker
    commits them (from stream entry ``after`` on; default the stream's start, i.e. the job's
    whole output so far; for a job already final, what the stream still holds), ``status`` on
    every change, ``final`` last. ``first``: the job as the caller just read it (saves a read).

    ``drain``: for a reader that can resume elsewhere (SSE's ``Last-Event-ID``), the replica's
    drain: once its deadline passes the generator ends without ``final`` (``api/drain.py``)."""
    client = reader.streams()
    key = redis_keys.events(job_id)
    cursor = after or event_stream.STREAM_START
    async with reader.waiter.watch(job_id) as finished:
        job = first or await run_in_threadpool(reader.read, job_id, tenant)
        if job is None:
            return
        yield Followed("status", job=job)
        if is_final(job):  # what the stream still holds (a resumed reader), then the result
            if job.purged_at is None:  # a purged job's text is gone, whatever a late write left
                async for block in _replay(client, key, cursor):
                    yield block
            yield Followed("final", job=job)
            return
        seen = (job.status, job.attempt)
        recheck = RECHECK_SECONDS
        next_read = time.monotonic() + recheck
        last_sent = time.monotonic()
        first_read = True
        while True:
            reread = False
            block_ms = _block_ms(drain)
            if block_ms <= 0:  # the replica stops: the reader resumes on another one
                return
            try:
                answer = await client.xread({key: cursor}, count=STREAM_BATCH, block=block_ms)
            except (RedisError, OSError) as exc:  # no stream: SQL and the notice still answer
                log.info("job_follow.stream_unavailable", job_id=job_id, error=type(exc).__name__)
                answer = []
                with suppress(TimeoutError):
                    await asyncio.wait_for(finished.wait(), block_ms / 1000)
            entries = _stream_entries(answer)
            if first_read and not entries and cursor == event_stream.STREAM_START:
                hot = _hot_block(job) if job.status == JobStatus.RUNNING else None
                if hot is not None:
                    yield Followed("block", job=job, event=hot)
                    last_sent = time.monotonic()
            first_read = False
            for entry_id, event in entries:
                cursor = entry_id
                if event.get("type") == "block":
                    yield Followed("block", job=job, event=event, entry_id=entry_id)
                    last_sent = time.monotonic()
                elif event.get("type") == "status":
                    reread = True
            now = time.monotonic()
            if reread or finished.is_set() or now >= next_read:
                finished.clear()
                fresh = await run_in_threadpool(reader.read, job_id, tenant)
                if fresh is None:
                    return
                job = fresh
                if (job.status, job.attempt) != seen or is_final(job):
                    seen = (job.status, job.attempt)
                    yield Followed("status", job=job)
                    last_sent = time.monotonic()
                if is_final(job):
                    # The blocks committed since the last XREAD are in the stream already (the
                    # worker writes its last events with the outcome): read them before the end.
                    async for block in _replay(client, key, cursor):
                        yield Followed("block", job=job, event=block.event, entry_id=block.entry_id)
                    yield Followed("final", job=job)
                    return
                recheck = RECHECK_SECONDS if reread else min(2 * recheck, MAX_RECHECK_SECONDS)
                next_read = time.monotonic() + recheck
            if time.monotonic() - last_sent >= keepalive_seconds:
                yield Followed("keepalive")
                last_sent = time.monotonic()
