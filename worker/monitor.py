"""The job monitor: ONE background thread per worker process that looks after every running job.

Task threads only submit to the engine and wait. Everything periodic happens here, batched over
all running jobs so its cost does not grow with per-job round trips:

- every tick (~0.1 s): one pipelined EXISTS over the jobs' cancel keys (a running job's cancel
  reaches the engine within one tick + one denoising pass) and one pipelined write of the
  latest progress snapshots to Redis, together with one event per block committed since the
  last tick on each job's event stream (``scheduler/jobs/event_stream.py``: counters plus the
  committed-text delta; the engine's ``on_progress`` only queues a snapshot, so the engine
  thread never waits on Redis or on the tokenizer);
- every ``lease_seconds / 3``: one UPDATE renewing all leases, which also reports jobs whose
  lease was lost (reaped, re-claimed elsewhere) — their engine requests are stopped, the job
  was handed back — and the SQL ``cancel_requested`` flag (backup for a lost Redis signal);
- every ``progress_sql_interval_seconds``: coarse progress to SQL (one executemany);
- for jobs whose webhook asked for ``progress``: a ``job.progress`` outbox row at most once per
  ``webhooks.progress_interval_seconds`` (``scheduler/webhooks/job_events.py``);
- every ``worker_heartbeat_seconds``: the worker registry entry.
"""

from __future__ import annotations

import collections
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
import structlog
from sqlalchemy.orm import Session, sessionmaker

from scheduler.infra import redis_keys
from scheduler.infra.settings import Settings
from scheduler.jobs import event_stream
from scheduler.jobs.lifecycle import Lease, renew_leases, sql_safe_text, write_progress
from scheduler.jobs.models import JobStatus
from scheduler.webhooks.job_events import PROGRESS_FIELDS, notify_job_progress
from scheduler.webhooks.progress import ProgressWebhook
from worker.engine.types import Progress

log = structlog.get_logger(__name__)

TICK_SECONDS = 0.1
REPLACEMENT = "\ufffd"  # what a decoder shows for an incomplete UTF-8 sequence

# Renders committed ids as (answer text, reasoning text or None); worker/execution.py passes one
# for thinking-mode jobs through ``on_plan``.
Render = Callable[[list[int]], tuple[str, str | None]]


@dataclass
class TextTracker:
    """The committed text of one channel as published so far, to publish only what is new.

    ``advance`` answers ``(offset, delta)`` with ``text == published[:offset] + delta``:
    normally ``offset`` is the length already published (an append); when decoding more ids
    changed earlier characters (bytes of one character split over two blocks), ``offset`` is
    where the texts part. A trailing replacement character is held back until the next block
    completes it, unless ``final``.
    """

    published: str = ""

    def advance(self, text: str, *, final: bool = False) -> tuple[int, str]:
        if not final:
            text = text.rstrip(REPLACEMENT)
        if text.startswith(self.published):
            offset = len(self.published)
        else:
            offset = next((i for i, (a, b) in enumerate(zip(text, self.published, strict=False)) if a != b),
                          min(len(text), len(self.published)))
        self.published = text
        return offset, text[offset:]


@dataclass
class RunningJob:
    """A job this worker holds: its lease, the engine's cancel event and its latest progress."""

    lease: Lease
    cancel_event: threading.Event
    step_budget: int | None
    status: str = JobStatus.RUNNING.value
    latest: Progress | None = None
    dirty: bool = True  # latest not yet pushed to Redis
    sql_dirty: bool = False  # latest not yet written to SQL
    lost: bool = False  # the lease was lost: another attempt owns the job now
    cancel_seen: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # Block events: snapshots queued by the engine thread, published by the monitor thread.
    pending: collections.deque[Progress] = field(default_factory=collections.deque)
    events: list[dict[str, Any]] = field(default_factory=list)  # built, not yet on the stream
    blocks_total: int | None = None  # planned blocks of the generated region (on_plan)
    prompt_tokens: int | None = None  # prompt positions to prefill (on_plan)
    render: Render | None = None
    text: TextTracker = field(default_factory=TextTracker)
    reasoning: TextTracker = field(default_factory=TextTracker)
    partial_text: str = ""  # the committed ids of ``latest``, decoded (for the hot status)
    # Set when the job's webhook_events name "progress" (scheduler/webhooks/job_events.py).
    progress_webhook: ProgressWebhook | None = None


class JobMonitor:
    """Tracks running jobs of this process; see the module docstring."""

    def __init__(
        self,
        *,
        settings: Settings,
        sessions: sessionmaker[Session],
        redis_client: redis.Redis,
        worker_id: str,
        decode: Callable[[list[int]], str],
        heartbeat: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.redis = redis_client
        self.worker_id = worker_id
        self.decode = decode
        self.heartbeat = heartbeat
        self._jobs: dict[uuid.UUID, RunningJob] = {}
        self._lock = threading.Lock()
        self._push_lock = threading.Lock()  # a final status write never races a progress push
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- called from task threads / the engine thread ------------------------------------------
    def add(self, lease: Lease, *, cancel_event: threading.Event, step_budget: int | None,
            progress_webhook: ProgressWebhook | None = None) -> RunningJob:
        job = RunningJob(lease=lease, cancel_event=cancel_event, step_budget=step_budget,
                         progress_webhook=progress_webhook)
        # published next tick
        job.events.append(event_stream.status_event(JobStatus.RUNNING.value, lease.attempt))
        with self._lock:
            self._jobs[lease.job_id] = job
        return job

    def remove(self, job_id: uuid.UUID) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def finish(self, job: RunningJob, status: str) -> None:
        """Stop tracking ``job`` and write its final hot status (after any in-flight push), with
        the events of its last blocks and the ``status`` event that ends the attempt.

        Never raises: it runs after the outcome is committed in SQL, and a Redis blip here must
        not cost the job's summary line, metrics and notices that follow (issue 16). Readers
        fall back to SQL, the truth, when the hot status is missing or stale."""
        with self._push_lock:
            self.remove(job.lease.job_id)
            job.status = status
            job.dirty = False
            self._collect_events(job)
            job.events.append(event_stream.status_event(status, job.lease.attempt))
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(redis_keys.progress(job.lease.job_id), json.dumps(self.snapshot(job)),
                     ex=redis_keys.PROGRESS_TTL_SECONDS)
            pipe.delete(redis_keys.cancel(job.lease.job_id))
            event_stream.add_events(pipe, job.lease.job_id, job.events,
                                  ttl_seconds=event_stream.FINISHED_TTL_SECONDS)
            job.events = []
            try:
                pipe.execute()
            except redis.RedisError as exc:
                log.warning("job.final_hot_status_failed", job_id=str(job.lease.job_id), status=status,
                            error=type(exc).__name__)

    def on_progress(self, job_id: uuid.UUID) -> Callable[[Progress], None]:
        """The engine callback for ``job_id``: queue the snapshot (cheap; runs on the engine thread).

        The engine calls it once per committed block; each call becomes one ``block`` event."""

        def record(progress: Progress) -> None:
            job = self._jobs.get(job_id)
            if job is not None:
                job.pending.append(progress)
                job.latest = progress
                job.dirty = True
                job.sql_dirty = True

        return record

    def on_plan(self, job_id: uuid.UUID) -> Callable[..., None]:
        """The callback worker/execution.py calls before submitting: the job's planned block
        count and, for thinking-mode jobs, how to split committed ids into answer and reasoning."""

        def plan(*, blocks_total: int | None = None, render: Render | None = None,
                 prompt_tokens: int | None = None) -> None:
            job = self._jobs.get(job_id)
            if job is not None:
                if blocks_total is not None:
                    job.blocks_total = blocks_total
                if prompt_tokens is not None:
                    job.prompt_tokens = prompt_tokens
                if render is not None:
                    job.render = render
                job.dirty = True

        return plan

    def final_progress(self, job: RunningJob, *, steps_used: int | None, tokens: int | None,
                       blocks: int | None, complete: bool) -> dict[str, Any]:
        """The progress of an attempt that ended, for SQL and the last hot status: never below
        what the job showed while it ran (the outcome counts the blocks the engine finished after
        its last report), and, for a job that ``complete``-d, ``blocks_total`` = the blocks it
        needed (a generation that stops at EOS needs fewer than planned)."""
        latest = job.latest
        done = max(blocks or 0, latest.blocks_done if latest else 0)
        steps = max(steps_used or 0, latest.steps_used if latest else 0)
        committed = max(tokens or 0, latest.tokens_committed if latest else 0)
        total = job.blocks_total
        total = (done or total) if complete or total is None else max(total, done)
        job.extra.update(blocks_done=done, steps_used=steps, tokens_committed=committed, blocks_total=total)
        doc = self.snapshot(job)
        doc.pop("partial_text", None)  # SQL keeps counters; text lives in Redis / the result
        return doc

    def running_count(self) -> int:
        return len(self._jobs)

    # --- the thread ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cloverq-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        lease_every = max(TICK_SECONDS, self.settings.jobs.lease_seconds / 3)
        next_lease = next_sql = next_beat = 0.0
        while not self._stop.wait(TICK_SECONDS):
            now = time.monotonic()
            try:
                with self._lock:
                    jobs = list(self._jobs.values())
                self._watch_cancels(jobs)
                self._push_progress(jobs)
                self._progress_webhooks(jobs)
                if now >= next_lease:
                    next_lease = now + lease_every
                    self._renew(jobs)
                if now >= next_sql:
                    next_sql = now + self.settings.jobs.progress_sql_interval_seconds
                    self._progress_to_sql(jobs)
                if now >= next_beat:
                    next_beat = now + self.settings.worker.heartbeat_seconds
                    self.heartbeat()
            except Exception:  # Redis/SQL hiccup: log and keep ticking; leases have slack
                log.exception("monitor.tick_failed")

    def _watch_cancels(self, jobs: list[RunningJob]) -> None:
        watched = [j for j in jobs if not j.cancel_event.is_set()]
        if not watched:
            return
        pipe = self.redis.pipeline(transaction=False)
        for job in watched:
            pipe.exists(redis_keys.cancel(job.lease.job_id))
        for job, flagged in zip(watched, pipe.execute(), strict=True):
            if flagged:
                job.cancel_seen = True
                job.cancel_event.set()

    def snapshot(self, job: RunningJob) -> dict[str, Any]:
        """The hot-status document of ``job`` (what ``scheduler.jobs.service.read_progress`` returns)."""
        p = job.latest
        doc: dict[str, Any] = {
            "status": job.status,
            "attempt": job.lease.attempt,
            "worker_id": self.worker_id,
            "step_budget": job.step_budget,
            "blocks_done": p.blocks_done if p else 0,
            "blocks_total": job.blocks_total,
            "steps_used": p.steps_used if p else 0,
            "tokens_committed": p.tokens_committed if p else 0,
            # Prefill: the engine runs a prompt's whole blocks inside its first pass and reports
            # nothing before that pass commits a block, so "done" is 0 of N while it prefills,
            # then N (finer steps need a report from inside the engine's prefill).
            "prompt_tokens": job.prompt_tokens,
            "prompt_tokens_done": None if job.prompt_tokens is None else (job.prompt_tokens if p else 0),
            "partial_text": job.partial_text,  # decoded once per block (_collect_events)
            "updated_at": time.time(),
        }
        doc.update(job.extra)
        return doc

    def _collect_events(self, job: RunningJob) -> None:
        """Turn the snapshots the engine queued into ``block`` events (one per committed block)."""
        while job.pending:
            progress = job.pending.popleft()
            ids = progress.committed_token_ids
            raw = sql_safe_text(self.decode(ids))  # as the outcome will store it (no NUL)
            text, reasoning = job.render(ids) if job.render is not None else (raw, None)
            text = sql_safe_text(text)
            reasoning = sql_safe_text(reasoning) if reasoning is not None else None
            job.partial_text = raw
            offset, delta = job.text.advance(text)
            event: dict[str, Any] = {
                "type": "block", "attempt": job.lease.attempt, "blocks_done": progress.blocks_done,
                "blocks_total": job.blocks_total, "steps_used": progress.steps_used,
                "step_budget": job.step_budget, "tokens_committed": progress.tokens_committed,
                "offset": offset, "delta": delta,
            }
            if reasoning is not None:
                event["reasoning_offset"], event["reasoning_delta"] = job.reasoning.advance(reasoning)
            job.events.append(event)

    def _push_progress(self, jobs: list[RunningJob]) -> None:
        with self._push_lock:
            dirty = [j for j in jobs if (j.dirty or j.events) and j.lease.job_id in self._jobs]
            if not dirty:
                return
            pipe = self.redis.pipeline(transaction=False)
            for job in dirty:
                self._collect_events(job)
                event_stream.add_events(pipe, job.lease.job_id, job.events)
                job.events = []
                if job.dirty:
                    job.dirty = False
                    pipe.set(redis_keys.progress(job.lease.job_id), json.dumps(self.snapshot(job)),
                             ex=redis_keys.PROGRESS_TTL_SECONDS)
            pipe.execute()

    def _renew(self, jobs: list[RunningJob]) -> None:
        held = [j for j in jobs if not j.lost]
        if not held:
            return
        with self.sessions() as session:
            check = renew_leases(session, leases=[j.lease for j in held], worker_id=self.worker_id,
                                 settings=self.settings)
        for job in held:
            if job.lease.job_id in check.lost:
                log.warning("job.lease_lost", job_id=str(job.lease.job_id), attempt=job.lease.attempt)
                job.lost = True
                job.cancel_event.set()
            elif job.lease.job_id in check.cancel_requested:
                job.cancel_seen = True
                job.cancel_event.set()

    def _progress_webhooks(self, jobs: list[RunningJob]) -> None:
        """``job.progress`` for the jobs that asked, each at most once per interval (the throttle);
        an outbox INSERT here, on the monitor thread, never on the engine's."""
        now = time.time()
        due = []
        for job in jobs:
            hook = job.progress_webhook
            if hook is None or job.latest is None or job.lost:
                continue
            doc = self.snapshot(job)
            sequence = hook.throttle.take(now, tuple(doc.get(name) for name in PROGRESS_FIELDS))
            if sequence is not None:
                due.append((job.lease.job_id, hook, sequence, doc))
        notify_job_progress(due, sessions=self.sessions)

    def _progress_to_sql(self, jobs: list[RunningJob]) -> None:
        updates = []
        for job in jobs:
            if job.sql_dirty and job.latest is not None and not job.lost:
                job.sql_dirty = False
                doc = self.snapshot(job)
                doc.pop("partial_text", None)  # SQL keeps counters; text lives in Redis / the result
                updates.append((job.lease, doc, job.latest.steps_used))
        if updates:
            with self.sessions() as session:
                write_progress(session, updates=updates)
