"""The job monitor: ONE background thread per worker process that looks after every running job.

Task threads only submit to the engine and wait. Everything periodic happens here, batched over
all running jobs so its cost does not grow with per-job round trips:

- every tick (~0.1 s): one pipelined EXISTS over the jobs' cancel keys (a running job's cancel
  reaches the engine within one tick + one denoising pass) and one pipelined write of the
  latest progress snapshots to Redis (the engine's ``on_progress`` only stores a snapshot);
- every ``lease_seconds / 3``: one UPDATE renewing all leases, which also reports jobs whose
  lease was lost (reaped, re-claimed elsewhere) — their engine requests are stopped, the job
  was handed back — and the SQL ``cancel_requested`` flag (backup for a lost Redis signal);
- every ``progress_sql_interval_seconds``: coarse progress to SQL (one executemany);
- every ``worker_heartbeat_seconds``: the worker registry entry.
"""

from __future__ import annotations

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

from scheduler import redis_keys
from scheduler.lifecycle import Lease, renew_leases, write_progress
from scheduler.settings import Settings
from worker.engine.types import Progress

log = structlog.get_logger(__name__)

TICK_SECONDS = 0.1


@dataclass
class RunningJob:
    """A job this worker holds: its lease, the engine's cancel event and its latest progress."""

    lease: Lease
    cancel_event: threading.Event
    step_budget: int | None
    status: str = "running"
    latest: Progress | None = None
    dirty: bool = True  # latest not yet pushed to Redis
    sql_dirty: bool = False  # latest not yet written to SQL
    lost: bool = False  # the lease was lost: another attempt owns the job now
    cancel_seen: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


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
    def add(self, lease: Lease, *, cancel_event: threading.Event, step_budget: int | None) -> RunningJob:
        job = RunningJob(lease=lease, cancel_event=cancel_event, step_budget=step_budget)
        with self._lock:
            self._jobs[lease.job_id] = job
        return job

    def remove(self, job_id: uuid.UUID) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def finish(self, job: RunningJob, status: str) -> None:
        """Stop tracking ``job`` and write its final hot status (after any in-flight push)."""
        with self._push_lock:
            self.remove(job.lease.job_id)
            job.status = status
            job.dirty = False
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(redis_keys.progress(job.lease.job_id), json.dumps(self.snapshot(job)),
                     ex=redis_keys.PROGRESS_TTL_SECONDS)
            pipe.delete(redis_keys.cancel(job.lease.job_id))
            pipe.execute()

    def on_progress(self, job_id: uuid.UUID) -> Callable[[Progress], None]:
        """The engine callback for ``job_id``: store the snapshot (cheap; runs on the engine thread)."""

        def record(progress: Progress) -> None:
            job = self._jobs.get(job_id)
            if job is not None:
                job.latest = progress
                job.dirty = True
                job.sql_dirty = True

        return record

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
        lease_every = max(TICK_SECONDS, self.settings.lease_seconds / 3)
        next_lease = next_sql = next_beat = 0.0
        while not self._stop.wait(TICK_SECONDS):
            now = time.monotonic()
            try:
                with self._lock:
                    jobs = list(self._jobs.values())
                self._watch_cancels(jobs)
                self._push_progress(jobs)
                if now >= next_lease:
                    next_lease = now + lease_every
                    self._renew(jobs)
                if now >= next_sql:
                    next_sql = now + self.settings.progress_sql_interval_seconds
                    self._progress_to_sql(jobs)
                if now >= next_beat:
                    next_beat = now + self.settings.worker_heartbeat_seconds
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
        """The hot-status document of ``job`` (what ``scheduler.jobs.read_progress`` returns)."""
        p = job.latest
        doc: dict[str, Any] = {
            "status": job.status,
            "attempt": job.lease.attempt,
            "worker_id": self.worker_id,
            "step_budget": job.step_budget,
            "blocks_done": p.blocks_done if p else 0,
            "steps_used": p.steps_used if p else 0,
            "tokens_committed": p.tokens_committed if p else 0,
            "partial_text": self.decode(p.committed_token_ids) if p else "",
            "updated_at": time.time(),
        }
        doc.update(job.extra)
        return doc

    def _push_progress(self, jobs: list[RunningJob]) -> None:
        with self._push_lock:
            dirty = [j for j in jobs if j.dirty and j.lease.job_id in self._jobs]
            if not dirty:
                return
            pipe = self.redis.pipeline(transaction=False)
            for job in dirty:
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
