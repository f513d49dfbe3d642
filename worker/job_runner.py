"""One job, from the Celery message to the fenced outcome: hand back, claim, run, record.

``JobRunner.run_job`` is what the Celery task calls from a pool thread:

1. **Hand back** a message this worker must not run now (draining, a class gate full, a model
   switch in progress): not claimed, its enqueued marker dropped, so the reconciler republishes
   it for another worker (or this one, later). Consumers are only delivery
   (``worker/consumers.py``); these checks are the guarantee.
2. **Claim** it in SQL (fenced: ``scheduler.jobs.lifecycle.claim_job``) on this worker's model version.
3. **Run** it on the engine through ``worker.execution.run_kind``, with the monitor tracking its
   lease, progress and cancel flag.
4. **Record** the outcome (fenced ``finish_job``), or a retry / dead letter (``retry_or_fail``),
   then the final hot status, the long-poll notice, the webhook and the metrics.

Test-only faults come from ``worker/fault_injection.py`` and only when a ``FaultInjector`` was
handed in (``settings.worker.fault_injection``).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import redis
import structlog
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, StatusCode
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from scheduler.infra import redis_keys
from scheduler.infra.settings import Settings
from scheduler.jobs.dead_messages import take_if_dead
from scheduler.jobs.finished_notice import publish_finished
from scheduler.jobs.lifecycle import Lease, claim_job, finish_job, retry_or_fail
from scheduler.jobs.models import ErrorCode, Job, JobStatus, utcnow
from scheduler.jobs.retry import InputJobError
from scheduler.jobs.routing import deadline_seconds
from scheduler.model_versions.canary_routing import queue_of_lane
from scheduler.observability import tracing
from scheduler.observability.metrics_recorder import RedisMetricsRecorder
from scheduler.webhooks.job_events import notify_job_started, progress_hook
from scheduler.webhooks.tasks import notify_job_finished
from worker.class_gates import INTERACTIVE_QUEUE, JOINT_QUEUE, ClassGate
from worker.engine.types import Progress
from worker.execution import run_kind
from worker.fault_injection import FaultInjector
from worker.job_handler import EngineContext, JobSpec, Outcome
from worker.model_switch_protocol import JobsInFlight
from worker.monitor import JobMonitor, RunningJob
from worker.resident_model import ResidentModel
from worker.run_outcome import RunOutcome
from worker.telemetry import JobFacts, observe_job_finished, retry_reason

log = structlog.get_logger(__name__)


class HandBackFailed(Exception):
    """A job could not be handed back through the reconciler (its marker stayed): requeue its
    message instead (``worker/tasks.py``)."""


class JobRunner:
    """Runs the jobs of one worker process (see the module docstring)."""

    def __init__(
        self,
        *,
        settings: Settings,
        sessions: sessionmaker[Session],
        redis_client: redis.Redis,
        worker_id: str,
        model: ResidentModel,
        monitor: JobMonitor,
        metrics: RedisMetricsRecorder,
        in_flight: JobsInFlight,
        joint_gate: ClassGate | None,
        capacity_gate: ClassGate | None,
        draining: threading.Event,
        lane: Callable[[], str | None],
        faults: FaultInjector | None = None,
        on_message: Callable[[str], None] | None = None,
    ) -> None:
        """``lane``: "canary" or "stable" for the job lines and metrics; ``faults``: tests only;
        ``on_message``: told the queue of every message taken (fair share releases the next held
        job into the room it left: ``scheduler/fairness/kicker.py``; it must not block)."""
        self.settings = settings
        self.sessions = sessions
        self.redis = redis_client
        self.worker_id = worker_id
        self.model = model
        self.monitor = monitor
        self.metrics = metrics
        self.in_flight = in_flight
        self.joint_gate = joint_gate
        self.capacity_gate = capacity_gate
        self.faults = faults
        self._on_message = on_message
        self._draining = draining
        self._lane = lane
        self._facts: dict[uuid.UUID, JobFacts] = {}

    def run_job(self, job_id: str, *, queue: str | None = None,
                trace_parent: Context | None = None) -> RunOutcome:
        """Claim, run and record one job; returns what happened (for logs/tests).

        ``queue`` is the queue the message came from: joint messages pass the joint gate (a
        canary lane counts as its class queue). ``trace_parent``: the trace context the message
        carried (``worker/tasks.py``); the attempt is a ``cloverq.run_job`` span under it, with
        the claim, the engine and the outcome write as its children (none when None).
        """
        with tracing.job_span("cloverq.run_job", trace_parent, kind=SpanKind.CONSUMER,
                              **tracing.job_attributes(job_id=job_id, queue=queue)) as span:
            outcome = self._run_job(job_id, queue=queue)
            if span is not None:
                span.set_attribute("cloverq.run_outcome", outcome.value)
                if outcome in (RunOutcome.FAILED, RunOutcome.RETRY_QUEUED, RunOutcome.RETRY_FAILED):
                    span.set_status(StatusCode.ERROR, outcome.value)
            return outcome

    def _run_job(self, job_id: str, *, queue: str | None) -> RunOutcome:
        lane = queue
        queue = queue_of_lane(queue) if queue is not None else None
        if self._on_message is not None and lane is not None and lane == queue:  # a class list has room
            self._on_message(queue)
        try:
            parsed = uuid.UUID(str(job_id))
        except ValueError:
            log.warning("job.bad_message", job_id=str(job_id))
            return RunOutcome.INVALID
        if lane is not None and self._dead(lane, parsed):  # cancelled while queued: no gate, no claim
            return RunOutcome.SKIPPED
        if self._draining.is_set():
            return self._hand_back(parsed, "job.handed_back_draining")
        gates = [g for g in (self.joint_gate if queue == JOINT_QUEUE else None,
                             self.capacity_gate if queue != INTERACTIVE_QUEUE else None) if g is not None]
        entered: list[ClassGate] = []
        for gate in gates:
            if not gate.try_enter():
                for held in entered:
                    held.leave()
                return self._hand_back(parsed, "job.handed_back_class_cap", queue=queue, cap=gate.cap)
            entered.append(gate)
        if not self.in_flight.enter():  # switching model versions: not claimed, republished later
            for held in entered:
                held.leave()
            return self._hand_back(parsed, "job.handed_back_switching")
        try:
            return self._claim_and_run(parsed)
        finally:
            self.in_flight.leave()
            for held in entered:
                held.leave()

    def _dead(self, lane: str, job_id: uuid.UUID) -> bool:
        """Whether this message is a cancelled job's (``scheduler.jobs.dead_messages``); Redis down: the
        claim decides."""
        try:
            return take_if_dead(self.redis, lane, job_id)
        except redis.RedisError:
            return False

    def _hand_back(self, parsed: uuid.UUID, event: str, **fields: object) -> RunOutcome:
        """Leave a job unclaimed: drop its enqueued marker so that the reconciler republishes it
        (for another worker, or this one later). A marker that cannot be dropped would hide the
        job from the reconciler until it expires (``redis_keys.ENQUEUED_TTL_SECONDS``), so then
        the message itself must go back: ``HandBackFailed`` (the task requeues it)."""
        try:
            self.redis.delete(redis_keys.enqueued(parsed))
        except redis.RedisError as exc:
            log.warning("job.hand_back_failed", job_id=str(parsed), error=type(exc).__name__)
            raise HandBackFailed(str(parsed)) from exc
        log.info(event, job_id=str(parsed), **fields)
        return RunOutcome.HANDED_BACK

    def _claim_and_run(self, parsed: uuid.UUID) -> RunOutcome:
        # From here on the claim in SQL says where the job is, so the enqueued marker goes first:
        # a worker killed before its claim commits leaves a queued row WITHOUT a marker, which the
        # reconciler republishes. Left in place, the marker would hide a message held in the dead
        # worker's unacked set until the visibility timeout (hours): the job stuck in ``queued``.
        # (A republish racing this claim is a fenced, harmless duplicate.)
        try:
            self.redis.delete(redis_keys.enqueued(parsed))
        except redis.RedisError as exc:  # Redis down: the claim still decides; recovery is periodic
            log.warning("job.marker_release_failed", job_id=str(parsed), error=type(exc).__name__)
        model_version = self.model.model_version
        with self.sessions() as session, tracing.span("cloverq.claim"):
            try:
                job = claim_job(session, job_id=parsed, worker_id=self.worker_id,
                                model_version=model_version, settings=self.settings,
                                served_version=self.model.served_version)
            except Exception:  # database hiccup: this message is spent; let the reconciler republish
                self.redis.delete(redis_keys.enqueued(parsed))
                raise
            if job is None:
                self._release_if_still_queued(session, parsed)
                log.warning("job.not_claimed", job_id=str(parsed))  # duplicate, cancelled or not due
                return RunOutcome.SKIPPED
            spec = JobSpec(job_id=str(job.id), kind=job.kind, queue=job.queue, attempt=job.attempt,
                           input=dict(job.input or {}), params=dict(job.params or {}))
            step_budget = job.step_budget
            tenant = job.tenant
            facts = JobFacts(created_at=job.created_at, started_at=job.started_at, step_budget=step_budget,
                             request_id=job.request_id)
            progress_webhook = progress_hook(job, interval=self.settings.webhooks.progress_interval_seconds)
            waited = (job.started_at - job.available_at).total_seconds() if job.started_at else 0.0
        self.metrics.safe(self.metrics.job_claimed, queue=spec.queue, tenant=tenant, wait_seconds=waited)
        notify_job_started(job, sessions=self.sessions)  # only when its webhook_events name it
        tracing.annotate(tracing.job_attributes(kind=spec.kind, queue=spec.queue, attempt=spec.attempt,
                                                model_version=model_version, tenant=tenant))
        structlog.contextvars.bind_contextvars(job_id=spec.job_id, kind=spec.kind, queue=spec.queue,
                                               attempt=spec.attempt, model_version=model_version,
                                               request_id=facts.request_id)
        self._facts[parsed] = facts
        lease = Lease(parsed, spec.attempt)
        cancel_event = threading.Event()
        running = self.monitor.add(lease, cancel_event=cancel_event, step_budget=step_budget,
                                   progress_webhook=progress_webhook)
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

    def _context(self, spec: JobSpec, lease: Lease, running: RunningJob) -> EngineContext:
        """What the kind's handler may use: the engine claimed on, the tokenizer, the plumbing."""
        engine, tokenizer = self.model.engine, self.model.tokenizer
        assert engine is not None and tokenizer is not None  # no job is admitted without a model
        return EngineContext(
            submit=engine.submit, submit_many=engine.submit_many,
            tokenizer=tokenizer, settings=self.settings,
            deadline=time.monotonic() + deadline_seconds(spec.queue, self.settings, spec.params),
            cancel_event=running.cancel_event, on_progress=self.monitor.on_progress(lease.job_id),
            on_plan=self.monitor.on_plan(lease.job_id),
            default_block_size=engine.default_block_size,
            joint_decode=self.model.joint_decode,
        )

    def _execute(self, spec: JobSpec, lease: Lease, running: RunningJob) -> RunOutcome:
        monitor = self.monitor
        ctx = self._context(spec, lease, running)
        try:
            if self.faults is not None:  # tests only (settings.worker.fault_injection)
                self.faults.before_run(spec, running.cancel_event)
            with tracing.span("cloverq.engine") as engine_span:
                if engine_span is not None:
                    ctx.on_progress = _block_events(engine_span, ctx.on_progress)
                outcome = run_kind(spec, ctx)
                if engine_span is not None:
                    _engine_timings(engine_span, outcome)
        except InputJobError as exc:
            outcome = Outcome(JobStatus.FAILED, error_code=ErrorCode.INVALID_INPUT.value,
                              error_message=str(exc))
        except Exception as exc:  # device fault (OOM), engine stopped, transient infra: retry with backoff
            return self._retry(spec, lease, running, repr(exc))
        if running.lost:
            log.warning("job.handed_back")  # another attempt owns it; write nothing
            return RunOutcome.LOST
        if outcome.status is JobStatus.CANCELLED and not running.cancel_seen:
            return self._retry(spec, lease, running, "interrupted (engine stopping)")
        # Final counters from the outcome (the last block may finish after the last report), never
        # below what the job showed while running: SQL's progress ends where the hot status did.
        usage = (outcome.result or {}).get("usage") or {}
        final = monitor.final_progress(running, steps_used=outcome.steps_used, tokens=outcome.tokens,
                                       blocks=usage.get("blocks"),
                                       complete=outcome.status is JobStatus.SUCCEEDED)
        with self.sessions() as session, tracing.span("cloverq.outcome_write"):
            written = finish_job(session, lease=lease, status=outcome.status, settings=self.settings,
                                 result=outcome.result, steps_used=outcome.steps_used,
                                 error_code=outcome.error_code, error_message=outcome.error_message,
                                 progress=final)
        running.status = outcome.status.value if written else running.status
        if written and outcome.result is not None and "text" in outcome.result:
            running.extra["partial_text"] = outcome.result["text"]
        monitor.finish(running, outcome.status.value if written else RunOutcome.LOST)
        if written:  # long-pollers (after the final hot status), webhooks, summary line, metrics
            publish_finished(self.redis, lease.job_id)
            notify_job_finished(lease.job_id, sessions=self.sessions)
            self._observe_finished(spec, lease, status=outcome.status.value, steps_used=outcome.steps_used,
                                   tokens=outcome.tokens, finish_reason=outcome.finish_reason,
                                   error_code=outcome.error_code)
        else:
            log.info("job.outcome_not_written", status=outcome.status.value)
        return RunOutcome.finished(outcome.status) if written else RunOutcome.LOST

    def _retry(self, spec: JobSpec, lease: Lease, running: RunningJob, error: str) -> RunOutcome:
        if running.lost:
            return RunOutcome.LOST
        with self.sessions() as session, tracing.span("cloverq.retry_or_fail") as span:
            status = retry_or_fail(session, lease=lease, error=error, settings=self.settings)
            if span is not None:
                span.set_attribute("cloverq.retry_reason", retry_reason(error))
                span.set_attribute("cloverq.next_status", status.value if status else "lost")
        if status is JobStatus.QUEUED:
            self.redis.delete(redis_keys.enqueued(lease.job_id))  # the reconciler republishes when due
            self.metrics.safe(self.metrics.job_retried, kind=spec.kind, queue=spec.queue,
                              reason=retry_reason(error))
        elif status is JobStatus.FAILED:  # retries exhausted: a dead letter, kept for inspection
            publish_finished(self.redis, lease.job_id)
            notify_job_finished(lease.job_id, sessions=self.sessions)
            self.metrics.safe(self.metrics.dead_letter, kind=spec.kind, queue=spec.queue)
            self._observe_finished(spec, lease, status=status.value, steps_used=None, tokens=None,
                                   finish_reason=None, error_code=ErrorCode.RETRIES_EXHAUSTED.value)
        running.status = status.value if status else running.status
        self.monitor.finish(running, status.value if status else RunOutcome.LOST)
        log.warning("job.attempt_failed", error=error, next_status=status.value if status else None)
        return RunOutcome.retried(status) if status else RunOutcome.LOST

    def _observe_finished(self, spec: JobSpec, lease: Lease, *, status: str, steps_used: int | None,
                          tokens: int | None, finish_reason: str | None, error_code: str | None) -> None:
        facts = self._facts.get(lease.job_id) or JobFacts(None, None, None, None)
        observe_job_finished(
            self.metrics, job_id=spec.job_id, kind=spec.kind, queue=spec.queue, status=status,
            attempt=spec.attempt, created_at=facts.created_at, started_at=facts.started_at,
            finished_at=utcnow(), steps_used=steps_used, step_budget=facts.step_budget, tokens=tokens,
            model_version=self.model.model_version, finish_reason=finish_reason, error_code=error_code,
            request_id=facts.request_id, logger=log, track=self._lane(),
        )


def _block_events(span: Span, report: Callable[[Progress], None]) -> Callable[[Progress], None]:
    """``report``, plus one ``block.committed`` event on the engine span per newly committed block
    (counts only: blocks, denoising passes, tokens; never the committed ids or text). It runs on
    the engine thread, so it is given the span rather than reading the current context."""
    last = [0]

    def on_progress(progress: Progress) -> None:
        if progress.blocks_done > last[0]:
            last[0] = progress.blocks_done
            span.add_event("block.committed", {"cloverq.blocks": progress.blocks_done,
                                               "cloverq.passes": progress.steps_used,
                                               "cloverq.tokens": progress.tokens_committed})
        report(progress)

    return on_progress


def _engine_timings(span: Span, outcome: Outcome) -> None:
    """The engine's own timings of the attempt on its span, and its queue wait (the time the
    request waited for a batch slot) as a child span ending where the engine run began."""
    timings = (outcome.result or {}).get("timings") or {}
    queue_s, run_s = timings.get("engine_queue_seconds"), timings.get("engine_run_seconds")
    span.set_attributes({"cloverq.passes": outcome.steps_used, "cloverq.tokens": outcome.tokens})
    if isinstance(queue_s, int | float) and isinstance(run_s, int | float):
        span.set_attributes({"cloverq.engine.queue_seconds": float(queue_s),
                             "cloverq.engine.run_seconds": float(run_s)})
        end = time.time_ns() - int(run_s * 1e9)
        wait = tracing.tracer().start_span("cloverq.engine.queue_wait", start_time=end - int(queue_s * 1e9))
        wait.end(end_time=end)
