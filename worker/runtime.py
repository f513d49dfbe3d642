"""The worker runtime: the resident model, the engine thread, the job monitor, the job lifecycle.

One per worker process. ``start`` loads the checkpoint ONCE, builds and starts the engine,
warms it up and only then lets the process report ready. ``run_job`` is what the Celery task
calls from a pool thread: fenced claim -> engine -> fenced outcome. Nothing here forks, so
CUDA is initialised in the process that uses it (threads pool; DESIGN.md decision 6).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from typing import Any

import structlog
import torch
from sqlalchemy import select
from sqlalchemy.orm import Session

from scheduler import redis_keys
from scheduler.db import get_session_factory
from scheduler.lifecycle import Lease, claim_job, finish_job, retry_or_fail
from scheduler.metrics import RedisMetricsRecorder, WorkerSnapshot
from scheduler.models import ErrorCode, Job, JobStatus, utcnow
from scheduler.redis_client import get_redis
from scheduler.retry import InputJobError, TransientJobError
from scheduler.routing import deadline_seconds
from scheduler.settings import Settings
from scheduler.webhook_tasks import notify_job_finished
from scheduler.workers import WorkerInfo, WorkerState, heartbeat_ttl, publish_worker, remove_worker
from worker.execution import EngineContext, JobSpec, Outcome, run_kind
from worker.joint_gate import JOINT_QUEUE, JointGate, joint_gate_for
from worker.monitor import JobMonitor, RunningJob
from worker.telemetry import (
    JobFacts,
    TelemetryThread,
    observe_job_finished,
    retry_reason,
    snapshot_from_stats,
)

log = structlog.get_logger(__name__)

# Test-only faults (honoured only when settings.fault_injection is on; never by default).
FAULTS: tuple[str, ...] = ("transient", "transient_once", "stall_first_attempt", "input", "crash")


class WorkerRuntime:
    """Everything a worker process holds; see the module docstring."""

    def __init__(self, settings: Settings, *, worker_id: str | None = None,
                 queues: tuple[str, ...] = ()) -> None:
        self.settings = settings
        self.worker_id = worker_id or f"cloverq-{os.getpid()}@{socket.gethostname()}"
        self.queues = queues
        self.sessions = get_session_factory(settings.resolved_database_url)
        self.redis = get_redis(settings.resolved_redis_url)
        self.info = WorkerInfo(id=self.worker_id, hostname=socket.gethostname(), pid=os.getpid(),
                               queues=list(queues), state=WorkerState.STARTING, started_at=time.time())
        self.engine: Any = None
        self.tokenizer: Any = None
        self.model_version: str | None = None
        self.monitor: JobMonitor | None = None
        self._ready = threading.Event()
        self._draining = threading.Event()
        # At most engine_joint_slot_cap joint jobs hold task threads (worker/joint_gate.py).
        self.joint_gate: JointGate | None = (
            joint_gate_for(cap=settings.engine_joint_slot_cap, node=self.worker_id, redis_client=self.redis)
            if JOINT_QUEUE in queues else None
        )
        # Observability: job outcomes and periodic snapshots go to Redis (see worker/telemetry.py).
        self.metrics = RedisMetricsRecorder(self.redis)
        self.telemetry: TelemetryThread | None = None
        self.model_name: str | None = None
        self._facts: dict[uuid.UUID, JobFacts] = {}
        # Follows the operator's drained-queue flags once the worker is ready (worker/queue_drain.py).
        self.drain_follower: Any = None

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Load the model, start and warm the engine, start the monitor (blocks until done)."""
        from worker.engine.engine import Engine, EngineConfig
        from worker.model.checkpoint import load_checkpoint

        self.heartbeat()
        began = time.monotonic()
        loaded = load_checkpoint(
            self.settings.resolved_model_dir, device=self.settings.device,
            dtype=getattr(torch, self.settings.dtype), verify=not self.settings.skip_verify,
        )
        loaded.model.eval()
        self.tokenizer = loaded.tokenizer
        self.model_version = f"{loaded.path.name}@{loaded.manifest_digest[:12]}"
        self.info.model_version = self.model_version
        self.engine = Engine(
            loaded.model,
            EngineConfig(max_batch=self.settings.engine_max_batch,
                         max_tokens_in_flight=self.settings.engine_max_tokens_in_flight,
                         slot_caps={"joint": self.settings.engine_joint_slot_cap}),
            mask_token_id=loaded.tokenizer.mask_token_id,
            eos_token_ids=loaded.tokenizer.eos_token_ids,
            default_block_size=loaded.config.block_size,
        )
        self.engine.start()
        self.engine.warm_up()
        self.info.stats["model_load_seconds"] = round(time.monotonic() - began, 3)
        self.model_name = loaded.path.name
        self.telemetry = TelemetryThread(self.metrics, self._metrics_snapshot,
                                         interval=self.settings.worker_metrics_interval)
        self.telemetry.start()
        self.monitor = JobMonitor(settings=self.settings, sessions=self.sessions, redis_client=self.redis,
                                  worker_id=self.worker_id, decode=self._decode, heartbeat=self.heartbeat)
        self.monitor.start()
        log.info("worker.loaded", worker_id=self.worker_id, model_version=self.model_version,
                 seconds=self.info.stats["model_load_seconds"])

    def mark_ready(self) -> None:
        self.info.state = WorkerState.READY
        self._ready.set()
        self.heartbeat()
        if self.telemetry is not None:
            self.telemetry.publish_now()  # the dashboard sees the worker as ready at once

    def mark_draining(self) -> None:
        """SIGTERM: the consumer stops taking jobs; running ones finish; say so in the registry.

        Celery cancels its consumer only a moment later; a message delivered in between is handed
        back unclaimed (see ``run_job``).
        """
        self._draining.set()
        if self.info.state != WorkerState.FAILED:
            self.info.state = WorkerState.DRAINING
        self.heartbeat()
        log.info("worker.draining", worker_id=self.worker_id)

    def stop(self) -> None:
        """After the pool drained: stop the engine (finishing anything left), leave the registry."""
        self.info.state = WorkerState.STOPPED
        if self.engine is not None:
            self.engine.stop(drain=True, timeout=30)
        if self.monitor is not None:
            self.monitor.stop()
        if self.telemetry is not None:
            self.telemetry.stop()
        remove_worker(self.redis, self.worker_id)
        log.info("worker.stopped", worker_id=self.worker_id)

    def heartbeat(self) -> None:
        if self.engine is not None:
            stats = self.engine.stats()
            if not stats.running and self.info.state == WorkerState.READY:
                self._engine_died()
            self.info.stats.update(running_jobs=self.monitor.running_count() if self.monitor else 0,
                                   batch_occupancy=stats.batch_occupancy,
                                   tokens_per_second=round(stats.tokens_per_second, 2))
        ttl = heartbeat_ttl(self.settings.worker_heartbeat_seconds)
        publish_worker(self.redis, self.info, ttl_seconds=ttl)
        if self.drain_follower is not None and self.info.state == WorkerState.READY:
            self.drain_follower.sync()

    def _engine_died(self) -> None:
        """The engine thread is gone: stop advertising readiness, hand back what arrives, and ask
        Celery for a warm shutdown so the process supervisor restarts a healthy worker."""
        log.error("worker.engine_dead", worker_id=self.worker_id)
        self.info.state = WorkerState.FAILED
        self._draining.set()
        os.kill(os.getpid(), signal.SIGTERM)

    def _metrics_snapshot(self) -> WorkerSnapshot:
        return snapshot_from_stats(
            self.engine.stats() if self.engine is not None else None, worker_id=self.worker_id,
            device=self.settings.device, queues=self.queues, state=self.info.state,
            model_name=self.model_name, model_version=self.model_version,
            model_load_seconds=self.info.stats.get("model_load_seconds"),
        )

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # --- one job ----------------------------------------------------------------------------------
    def run_job(self, job_id: str, *, queue: str | None = None) -> str:
        """Claim, run and record one job; returns what happened (for logs/tests).

        ``queue`` is the queue the message came from: joint messages pass the joint gate.
        """
        try:
            parsed = uuid.UUID(str(job_id))
        except ValueError:
            log.warning("job.bad_message", job_id=str(job_id))
            return "invalid"
        if self._draining.is_set():
            # Not claimed: dropping the marker lets the reconciler publish it for another worker.
            self.redis.delete(redis_keys.enqueued(parsed))
            log.warning("job.handed_back_draining", job_id=str(parsed))
            return "handed_back"
        gate = self.joint_gate if queue == JOINT_QUEUE else None
        if gate is not None and not gate.try_enter():
            self.redis.delete(redis_keys.enqueued(parsed))  # unclaimed: the reconciler republishes it
            log.info("job.handed_back_joint_cap", job_id=str(parsed), cap=gate.cap)
            return "handed_back"
        try:
            return self._claim_and_run(parsed)
        finally:
            if gate is not None:
                gate.leave()

    def _claim_and_run(self, parsed: uuid.UUID) -> str:
        with self.sessions() as session:
            try:
                job = claim_job(session, job_id=parsed, worker_id=self.worker_id,
                                model_version=self.model_version, settings=self.settings)
            except Exception:  # database hiccup: this message is spent; let the reconciler republish
                self.redis.delete(redis_keys.enqueued(parsed))
                raise
            if job is None:
                self._release_if_still_queued(session, parsed)
                log.warning("job.not_claimed", job_id=str(parsed))  # duplicate, cancelled or not due
                return "skipped"
            spec = JobSpec(job_id=str(job.id), kind=job.kind, queue=job.queue, attempt=job.attempt,
                           input=dict(job.input or {}), params=dict(job.params or {}))
            step_budget = job.step_budget
            facts = JobFacts(created_at=job.created_at, started_at=job.started_at, step_budget=step_budget,
                             request_id=job.request_id)
        assert self.monitor is not None
        structlog.contextvars.bind_contextvars(job_id=spec.job_id, kind=spec.kind, queue=spec.queue,
                                               attempt=spec.attempt, model_version=self.model_version,
                                               request_id=facts.request_id)
        self._facts[parsed] = facts
        lease = Lease(parsed, spec.attempt)
        cancel_event = threading.Event()
        running = self.monitor.add(lease, cancel_event=cancel_event, step_budget=step_budget)
        try:
            return self._execute(spec, lease, running)
        finally:
            self.monitor.remove(parsed)
            self._facts.pop(parsed, None)
            structlog.contextvars.unbind_contextvars("job_id", "kind", "queue", "attempt", "model_version",
                                                     "request_id")

    def _release_if_still_queued(self, session: Session, job_id: uuid.UUID) -> None:
        """A skipped message whose job is still queued (not due yet on this clock) must not leave
        the enqueued marker behind, or the reconciler would never publish the job again."""
        status = session.scalar(select(Job.status).where(Job.id == job_id, Job.cancel_requested.is_(False)))
        if status == JobStatus.QUEUED.value:
            self.redis.delete(redis_keys.enqueued(job_id))

    def _execute(self, spec: JobSpec, lease: Lease, running: RunningJob) -> str:
        ctx = EngineContext(
            submit=self.engine.submit, tokenizer=self.tokenizer, settings=self.settings,
            deadline=time.monotonic() + deadline_seconds(spec.queue, self.settings, spec.params),
            cancel_event=running.cancel_event, on_progress=self.monitor.on_progress(lease.job_id),
        )
        try:
            self._inject_fault(spec, running)
            outcome = run_kind(spec, ctx)
        except InputJobError as exc:
            outcome = Outcome(JobStatus.FAILED, error_code=ErrorCode.INVALID_INPUT.value,
                              error_message=str(exc))
        except Exception as exc:  # device fault (OOM), engine stopped, transient infra: retry with backoff
            return self._retry(spec, lease, running, repr(exc))
        if running.lost:
            log.warning("job.handed_back")  # another attempt owns it; write nothing
            return "lost"
        if outcome.status is JobStatus.CANCELLED and not running.cancel_seen:
            return self._retry(spec, lease, running, "interrupted (engine stopping)")
        with self.sessions() as session:
            written = finish_job(session, lease=lease, status=outcome.status, settings=self.settings,
                                 result=outcome.result, steps_used=outcome.steps_used,
                                 error_code=outcome.error_code, error_message=outcome.error_message)
        running.status = outcome.status.value if written else running.status
        self._final_hot_status(running, outcome.status.value if written else "lost")
        if written:  # webhooks (outbox + publish), the one summary line, finished metrics
            notify_job_finished(lease.job_id, sessions=self.sessions)
            self._observe_finished(spec, lease, status=outcome.status.value, steps_used=outcome.steps_used,
                                   tokens=outcome.tokens, finish_reason=outcome.finish_reason,
                                   error_code=outcome.error_code)
        else:
            log.info("job.outcome_not_written", status=outcome.status.value)
        return outcome.status.value if written else "lost"

    def _retry(self, spec: JobSpec, lease: Lease, running: RunningJob, error: str) -> str:
        if running.lost:
            return "lost"
        with self.sessions() as session:
            status = retry_or_fail(session, lease=lease, error=error, settings=self.settings)
        if status is JobStatus.QUEUED:
            self.redis.delete(redis_keys.enqueued(lease.job_id))  # the reconciler republishes when due
            self.metrics.safe(self.metrics.job_retried, kind=spec.kind, queue=spec.queue,
                              reason=retry_reason(error))
        elif status is JobStatus.FAILED:  # retries exhausted: a dead letter, kept for inspection
            notify_job_finished(lease.job_id, sessions=self.sessions)
            self.metrics.safe(self.metrics.dead_letter, kind=spec.kind, queue=spec.queue)
            self._observe_finished(spec, lease, status=status.value, steps_used=None, tokens=None,
                                   finish_reason=None, error_code=ErrorCode.RETRIES_EXHAUSTED.value)
        running.status = status.value if status else running.status
        self._final_hot_status(running, status.value if status else "lost")
        log.warning("job.attempt_failed", error=error, next_status=status.value if status else None)
        return f"retry:{status.value}" if status else "lost"

    def _observe_finished(self, spec: JobSpec, lease: Lease, *, status: str, steps_used: int | None,
                          tokens: int | None, finish_reason: str | None, error_code: str | None) -> None:
        facts = self._facts.get(lease.job_id) or JobFacts(None, None, None, None)
        observe_job_finished(
            self.metrics, job_id=spec.job_id, kind=spec.kind, queue=spec.queue, status=status,
            attempt=spec.attempt, created_at=facts.created_at, started_at=facts.started_at,
            finished_at=utcnow(), steps_used=steps_used, step_budget=facts.step_budget, tokens=tokens,
            model_version=self.model_version, finish_reason=finish_reason, error_code=error_code,
            request_id=facts.request_id, logger=log,
        )

    def _final_hot_status(self, running: RunningJob, status: str) -> None:
        assert self.monitor is not None
        self.monitor.finish(running, status)

    def _inject_fault(self, spec: JobSpec, running: RunningJob) -> None:
        """TESTS ONLY (``settings.fault_injection``): simulate faults named by ``params.fault``."""
        fault = spec.params.get("fault")
        if not fault or not self.settings.fault_injection:
            return
        if fault == "transient" or (fault == "transient_once" and spec.attempt == 1):
            raise TransientJobError(f"injected transient fault (attempt {spec.attempt})")
        if fault == "input":
            raise InputJobError("injected input error")
        if fault == "crash":  # a poison job: the process dies mid-job, every attempt (chaos tests)
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "stall_first_attempt" and spec.attempt == 1:
            running.cancel_event.wait(self.settings.fault_stall_seconds)


_runtime: WorkerRuntime | None = None


def set_runtime(runtime: WorkerRuntime | None) -> None:
    global _runtime
    _runtime = runtime


def get_runtime() -> WorkerRuntime:
    if _runtime is None:
        raise RuntimeError("the worker runtime is not started (run through worker.celery_worker)")
    return _runtime
