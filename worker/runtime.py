"""The worker runtime: the resident model, the engine thread, the job monitor, the job lifecycle.

One per worker process. ``start`` loads the checkpoint ONCE, builds and starts the engine,
warms it up and only then lets the process report ready. ``run_job`` is what the Celery task
calls from a pool thread: fenced claim -> engine -> fenced outcome. Nothing here forks, so
CUDA is initialised in the process that uses it (threads pool; docs/architecture.md §3.6).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import structlog
import torch
from sqlalchemy import select
from sqlalchemy.orm import Session

from scheduler import redis_keys
from scheduler.canary_routing import lane_names, queue_of_lane, served_target
from scheduler.db import get_session_factory
from scheduler.drain import drained_queues
from scheduler.heap import freeze_startup_heap, thaw_heap
from scheduler.job_events import publish_finished
from scheduler.lifecycle import Lease, claim_job, finish_job, retry_or_fail
from scheduler.metrics import RedisMetricsRecorder, WorkerSnapshot, set_process_version, version_label
from scheduler.model_versions import Activation, active_version, ensure_active, register_version, store_path
from scheduler.models import ErrorCode, Job, JobStatus, utcnow
from scheduler.redis_client import get_redis
from scheduler.retry import InputJobError, TransientJobError
from scheduler.routing import deadline_seconds
from scheduler.settings import Settings
from scheduler.webhook_tasks import notify_job_finished
from scheduler.workers import WorkerInfo, WorkerState, heartbeat_ttl, publish_worker, remove_worker
from worker.execution import EngineContext, JobSpec, Outcome, run_kind
from worker.joint_gate import (
    INTERACTIVE_QUEUE,
    JOINT_QUEUE,
    JointGate,
    capacity_gate_for,
    interactive_reserve,
    joint_gate_for,
)
from worker.model_switch import SWITCHING, JobAdmission, ModelFollower, SwitchTurn, consumer_control
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
                               queues=list(queues), state=WorkerState.STARTING, started_at=time.time(),
                               heartbeat_seconds=settings.worker_heartbeat_seconds)
        self.engine: Any = None
        self.tokenizer: Any = None
        self.model_version: str | None = None
        self.monitor: JobMonitor | None = None
        self._ready = threading.Event()
        self._draining = threading.Event()
        # Canaries (scheduler/canary.py): True while this worker serves the canary version and
        # consumes the canary lanes (canary.<queue>) instead of the class queues.
        self.canary_lane = False
        # At most engine_joint_slot_cap joint jobs hold task threads (worker/joint_gate.py).
        self.joint_gate: JointGate | None = (
            joint_gate_for(cap=settings.engine_joint_slot_cap, node=self.worker_id, redis_client=self.redis,
                           lane=self.lane_name)
            if JOINT_QUEUE in queues else None
        )
        # Every class but interactive holds at most engine_max_batch task threads (and engine slots);
        # the engine_interactive_reserve beyond are interactive's alone (issue 15: short first).
        self.reserve = interactive_reserve(queues, settings.engine_interactive_reserve)
        self.capacity_gate: JointGate | None = (
            capacity_gate_for(cap=settings.engine_max_batch, node=self.worker_id, redis_client=self.redis,
                              queues=queues, lane=self.lane_name)
            if self.reserve else None
        )
        # Observability: job outcomes and periodic snapshots go to Redis (see worker/telemetry.py).
        self.metrics = RedisMetricsRecorder(self.redis)
        self.telemetry: TelemetryThread | None = None
        self.model_name: str | None = None
        self._facts: dict[uuid.UUID, JobFacts] = {}
        # Follows the operator's drained-queue flags once the worker is ready (worker/queue_drain.py).
        self.drain_follower: Any = None
        # Model versions: the version of served_model loaded now, its watcher, and the gate that
        # keeps jobs out while a switch drains and loads (worker/model_switch.py).
        self.served_version: str | None = None
        self.follower: ModelFollower | None = None
        self.admission = JobAdmission()
        self.info.stats["model_track"] = settings.model_track
        self.info.stats["served_model"] = settings.served_model

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Load the model, start and warm the engine, start the monitor (blocks until done)."""
        self.heartbeat()
        torch.set_num_threads(self.settings.resolved_torch_threads)  # before the model's first op
        began = time.monotonic()
        if self.settings.served_model:  # follow the active version in SQL (worker/model_switch.py)
            activation = self._initial_activation(self.settings.served_model)
            version, on_lane = served_target(stable=activation.version, canary=activation.canary_version,
                                             track=self.settings.model_track)
            self._load_engine(self._store_path(version))
            self.model_name = self.settings.served_model
            self.served_version = version
            self._set_lane(on_lane)
            self._register_loaded()
        else:
            loaded = self._load_engine(self.settings.resolved_model_dir)
            self.model_name = loaded.path.name
        self.info.stats["model_load_seconds"] = round(time.monotonic() - began, 3)
        self.telemetry = TelemetryThread(self.metrics, self._metrics_snapshot,
                                         interval=self.settings.worker_metrics_interval)
        self.telemetry.start()
        self.monitor = JobMonitor(settings=self.settings, sessions=self.sessions, redis_client=self.redis,
                                  worker_id=self.worker_id, decode=self._decode, heartbeat=self.heartbeat)
        self.monitor.start()
        if self.settings.served_model:  # started by mark_ready, once Celery consumes
            self.follower = self._model_follower(self.settings.served_model)
        log.info("worker.loaded", worker_id=self.worker_id, model_version=self.model_version,
                 seconds=self.info.stats["model_load_seconds"])

    def _load_engine(self, path: Path) -> Any:
        """Load (and verify) the checkpoint at ``path``, start and warm up its engine, and make it
        the one jobs run on; returns the loaded checkpoint."""
        from worker.engine.engine import Engine, EngineConfig
        from worker.model.quantize import load_model

        if self.settings.tensor_parallel > 1 and self.settings.weight_dtype:  # not quantized per rank yet
            raise RuntimeError("CLOVERQ_WEIGHT_DTYPE is not supported with CLOVERQ_TENSOR_PARALLEL > 1 yet")
        if self.settings.tensor_parallel > 1:  # ranks 1..N-1 in processes of their own
            from worker.tensor_parallel import load_sharded

            loaded = load_sharded(self, path)
        else:
            verify = False if self.settings.skip_verify else self.settings.verify_on_load
            loaded = load_model(path, device=self.settings.device, dtype=self.load_dtype(path),
                                verify=verify, weight_dtype=self.settings.weight_dtype,
                                group_size=self.settings.weight_group_size)  # int8/int4: quantize.py
        loaded.model.eval()
        self._record_load(loaded)
        engine = Engine(
            loaded.model,
            EngineConfig(max_batch=self.settings.engine_max_batch,
                         max_tokens_in_flight=self.settings.engine_max_tokens_in_flight,
                         prefix_cache_bytes=self.settings.prefix_cache_bytes,
                         max_len=self.settings.resolved_engine_max_len,
                         slot_caps={"joint": self.settings.engine_joint_slot_cap},
                         reserved_slots=self.reserve, reserved_classes=frozenset({INTERACTIVE_QUEUE})),
            mask_token_id=loaded.tokenizer.mask_token_id,
            eos_token_ids=loaded.tokenizer.eos_token_ids,
            default_block_size=loaded.config.block_size,
        )
        engine.start()
        try:
            engine.warm_up()
        except BaseException:
            engine.stop(drain=False, timeout=30)
            raise
        self.engine, self.tokenizer = engine, loaded.tokenizer
        self.model_version = f"{loaded.path.name}@{loaded.manifest_digest[:12]}"
        self.info.model_version = self.model_version
        set_process_version(version_label(self.model_version), self.info.stats.get("lane"))
        return loaded

    def load_dtype(self, path: Path) -> torch.dtype:
        """The dtype to load ``path`` in: CLOVERQ_DTYPE, else its config.json's, else float32."""
        from worker.model.checkpoint import read_config
        from worker.model.hf_defaults import resolve_dtype

        if self.settings.dtype:
            return resolve_dtype(None, self.settings.dtype)
        return resolve_dtype(read_config(path))

    def _record_load(self, loaded: Any) -> None:
        """What the load cost and chose, in the log and the registry (``stats.model_verify``): the
        manifest check's bytes read against the checkpoint's size shows a quick check's saving."""
        from worker.model.hf_defaults import GenerationDefaults

        report = loaded.verification
        verify = None if report is None else {
            "mode": report.mode, "files": report.files, "bytes_total": report.bytes_total,
            "bytes_read": report.bytes_read, "seconds": round(report.seconds, 4),
        }
        self.info.stats["model_verify"] = verify
        dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
        log.info("worker.model_checked", path=str(loaded.path), dtype=dtype, verify=verify,
                 block_size=loaded.config.block_size, family=loaded.config.family,
                 generation_defaults=GenerationDefaults.from_dict(loaded.generation_config).as_log())

    # --- model versions (worker/model_switch.py) -------------------------------------------------
    def _store_path(self, version: str) -> Path:
        assert self.settings.served_model
        return store_path(self.settings.resolved_model_root, self.settings.served_model, version)

    def _initial_activation(self, name: str) -> Activation:
        """The version to load at start: the active one, else ``served_model_initial_version``
        (which becomes active when no version is)."""
        with self.sessions() as session:
            current = active_version(session, name=name)
            if current is not None:
                return current
            initial = self.settings.served_model_initial_version
            if not initial:
                raise RuntimeError(f"model {name!r} has no active version: run `cloverq model activate "
                                   f"{name} VERSION` or set CLOVERQ_SERVED_MODEL_INITIAL_VERSION")
            return ensure_active(session, name=name, version=initial, path=self._store_path(initial))

    def _register_loaded(self) -> None:
        """Record the served version in SQL (idempotent), so the admin API lists it."""
        assert self.settings.served_model and self.served_version
        with self.sessions() as session:
            register_version(session, name=self.settings.served_model, version=self.served_version,
                             path=self._store_path(self.served_version))

    def _model_follower(self, name: str) -> ModelFollower:
        return ModelFollower(
            model_name=name, sessions=self.sessions,
            turn=SwitchTurn(self.redis, model_name=name, worker_id=self.worker_id),
            interval=self.settings.model_watch_interval_seconds,
            current=lambda: self.served_version, switch=self.switch_model,
            track=self.settings.model_track, current_lane=lambda: self.canary_lane, move_lane=self.move_lane,
        )

    # --- canary lanes (scheduler/canary_routing.py) ---------------------------------------------
    def lane_name(self, queue: str) -> str:
        """The Celery queue this worker consumes for class ``queue`` (its canary lane or itself)."""
        return lane_names([queue], canary=self.canary_lane)[0]

    def _set_lane(self, on_lane: bool) -> None:
        self.canary_lane = on_lane
        self.info.stats["lane"] = "canary" if on_lane else "stable"
        set_process_version(version_label(self.model_version), self.info.stats["lane"])

    def use_lane_at_start(self, queues: Any) -> None:
        """On ``worker_init``, after ``start``: a canary worker starting during a canary consumes
        the canary lanes from its first message on (``queues``: the app's ``amqp.queues``)."""
        if not self.canary_lane:
            return
        plain = self.drain_follower.consuming if self.drain_follower is not None else list(self.queues)
        queues.deselect(plain)
        for name in lane_names(plain, canary=True):
            queues.select_add(name)
        log.info("worker.canary_lanes_at_start", queues=lane_names(plain, canary=True))

    def move_lane(self, on_lane: bool) -> None:
        """Same version, other lane (a promotion leaves a canary worker on its version): move the
        consumers only. The claim's version check is the guarantee; consumers are delivery."""
        queues = self.drain_follower.consuming if self.drain_follower is not None else list(self.queues)
        self._consumers("cancel", queues)
        self._set_lane(on_lane)
        self._consumers("add", queues)
        self._quietly(self.heartbeat)
        log.info("worker.lane_moved", lane=self.info.stats["lane"], version=self.served_version)

    def switch_model(self, activation: Activation) -> bool:
        """Drain, load ``activation``'s version, warm up, take jobs again (module doc of
        worker/model_switch.py). Returns False (still serving the old version) if it cannot load.
        ``activation.version`` is the version this worker's track serves (``ModelFollower``): on
        the canary lanes when it is the canary version."""
        target = self._store_path(activation.version)
        if not (target / "manifest.json").is_file():
            log.error("worker.model_switch_missing", version=activation.version, path=str(target))
            self.info.stats["model_switch_error"] = f"{activation.version}: not in the store at {target}"
            return False
        if self._draining.is_set():
            return False
        began = time.monotonic()
        old_version = self.model_version
        log.info("worker.model_switch_started", version=activation.version, previous=old_version)
        self.info.state = SWITCHING
        queues = self.drain_follower.consuming if self.drain_follower is not None else list(self.queues)
        outcome: bool | None = False
        try:
            self._quietly(self.heartbeat)
            self._consumers("cancel", queues)
            self.admission.close_and_wait()  # every claimed job finishes on the old version
            outcome = self._swap_engine(activation.version)
            if outcome:
                self._set_lane(activation.version == activation.canary_version)
        finally:  # whatever happened, a worker with a model takes jobs again
            if outcome is not None:
                self._resume_after_switch(queues)
        if outcome:
            self.info.stats.pop("model_switch_error", None)
            self._quietly(self._register_loaded)
        seconds = self.info.stats["model_switch_seconds"] = round(time.monotonic() - began, 3)
        log.info("worker.model_switched" if outcome else "worker.model_switch_abandoned",
                 version=self.model_version, previous=old_version, seconds=seconds)
        return bool(outcome)

    def _swap_engine(self, version: str) -> bool | None:
        """Stop the drained engine, load ``version``; on failure reload the served one.
        True: switched; False: still on the old version; None: no model left (worker fails)."""
        previous = self.served_version
        self.engine.stop(drain=True, timeout=60)
        self.engine = None  # frees the old weights before the new ones load
        thaw_heap()  # the old model was frozen at start-up: let any cycle of it be collected
        try:
            self._load_engine(self._store_path(version))
            self.served_version = version
            freeze_startup_heap()
            return True
        except Exception as exc:  # corrupt or unloadable version: go back to the one we had
            log.error("worker.model_switch_failed", version=version, error=repr(exc))
            self.info.stats["model_switch_error"] = f"{version}: {exc!r}"[:500]
        try:
            assert previous is not None
            self._load_engine(self._store_path(previous))
            return False
        except Exception as again:
            log.error("worker.model_reload_failed", version=previous, error=repr(again))
            self._engine_died()
            return None

    def _resume_after_switch(self, queues: list[str]) -> None:
        self.admission.open()
        if self._draining.is_set():  # SIGTERM arrived meanwhile: stay out of the pool
            return
        self.info.state = WorkerState.READY
        try:
            drained = drained_queues(self.redis)
        except Exception as exc:  # Redis hiccup: the drain follower corrects it at a heartbeat
            log.warning("worker.drain_flags_unreadable", error=type(exc).__name__)
            drained = set()
        self._consumers("add", [q for q in queues if q not in drained])
        self._quietly(self.heartbeat)
        if self.telemetry is not None:
            self._quietly(self.telemetry.publish_now)

    @staticmethod
    def _quietly(action: Callable[[], object]) -> None:
        """Registry and bookkeeping writes during a switch: a Redis or SQL hiccup is logged and
        the switch goes on (the next heartbeat publishes again)."""
        try:
            action()
        except Exception as exc:
            log.warning("worker.model_switch_write_failed", action=getattr(action, "__name__", "?"),
                        error=f"{type(exc).__name__}: {exc}")

    def _consumers(self, action: str, queues: list[str]) -> None:
        """Cancel or add this worker's consumers (an optimisation: ``admission`` is the guarantee)."""
        if not queues:
            return
        from scheduler.celery_app import get_celery_app

        cancel, add = consumer_control(get_celery_app(), node=self.worker_id)
        try:
            (cancel if action == "cancel" else add)(lane_names(queues, canary=self.canary_lane))
        except Exception as exc:
            log.warning("worker.consumer_switch_failed", action=action, error=f"{type(exc).__name__}: {exc}")

    def mark_ready(self) -> None:
        freeze_startup_heap()  # the model and the libraries stay: keep full GCs short
        self.info.state = WorkerState.READY
        self._ready.set()
        self.heartbeat()
        if self.telemetry is not None:
            self.telemetry.publish_now()  # the dashboard sees the worker as ready at once
        if self.follower is not None:  # watch the active version only once consumers exist
            self.follower.start()

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
        if self.follower is not None:
            self.follower.stop()
        if self.engine is not None:
            self.engine.stop(drain=True, timeout=30)
        if self.monitor is not None:
            self.monitor.stop()
        if self.telemetry is not None:
            self.telemetry.stop()
        remove_worker(self.redis, self.worker_id)
        log.info("worker.stopped", worker_id=self.worker_id)

    def heartbeat(self) -> None:
        engine = self.engine  # a model switch replaces it; read it once
        if engine is not None:
            stats = engine.stats()
            if not stats.running and self.info.state == WorkerState.READY and engine is self.engine:
                self._engine_died()
            self.info.stats.update(running_jobs=self.monitor.running_count() if self.monitor else 0,
                                   batch_occupancy=stats.batch_occupancy,
                                   tokens_per_second=round(stats.tokens_per_second, 2),
                                   engine_passes=stats.passes,
                                   engine_busy_seconds=round(stats.busy_seconds, 3))
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
        engine = self.engine
        return snapshot_from_stats(
            engine.stats() if engine is not None else None, worker_id=self.worker_id,
            device=self.settings.device, queues=self.queues, state=self.info.state,
            model_name=self.model_name, model_version=self.model_version,
            model_load_seconds=self.info.stats.get("model_load_seconds"),
            track=self.info.stats.get("lane"),
        )

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # --- one job ----------------------------------------------------------------------------------
    def run_job(self, job_id: str, *, queue: str | None = None) -> str:
        """Claim, run and record one job; returns what happened (for logs/tests).

        ``queue`` is the queue the message came from: joint messages pass the joint gate (a
        canary lane counts as its class queue).
        """
        queue = queue_of_lane(queue) if queue is not None else None
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
        gates = [g for g in (self.joint_gate if queue == JOINT_QUEUE else None,
                             self.capacity_gate if queue != INTERACTIVE_QUEUE else None) if g is not None]
        entered: list[JointGate] = []
        for gate in gates:
            if not gate.try_enter():
                for held in entered:
                    held.leave()
                self.redis.delete(redis_keys.enqueued(parsed))  # unclaimed: the reconciler republishes it
                log.info("job.handed_back_class_cap", job_id=str(parsed), queue=queue, cap=gate.cap)
                return "handed_back"
            entered.append(gate)
        if not self.admission.enter():  # switching model versions: not claimed, republished later
            for held in entered:
                held.leave()
            self.redis.delete(redis_keys.enqueued(parsed))
            log.info("job.handed_back_switching", job_id=str(parsed))
            return "handed_back"
        try:
            return self._claim_and_run(parsed)
        finally:
            self.admission.leave()
            for held in entered:
                held.leave()

    def _claim_and_run(self, parsed: uuid.UUID) -> str:
        # From here on the claim in SQL says where the job is, so the enqueued marker goes first:
        # a worker killed before its claim commits leaves a queued row WITHOUT a marker, which the
        # reconciler republishes. Left in place, the marker would hide a message held in the dead
        # worker's unacked set until the visibility timeout (hours): the job stuck in ``queued``.
        # (A republish racing this claim is a fenced, harmless duplicate.)
        try:
            self.redis.delete(redis_keys.enqueued(parsed))
        except redis.RedisError as exc:  # Redis down: the claim still decides; recovery is periodic
            log.warning("job.marker_release_failed", job_id=str(parsed), error=type(exc).__name__)
        with self.sessions() as session:
            try:
                job = claim_job(session, job_id=parsed, worker_id=self.worker_id,
                                model_version=self.model_version, settings=self.settings,
                                served_version=self.served_version)
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
        monitor = self.monitor
        assert monitor is not None  # started before any job is claimed
        ctx = EngineContext(
            submit=self.engine.submit, submit_many=getattr(self.engine, "submit_many", None),
            tokenizer=self.tokenizer, settings=self.settings,
            deadline=time.monotonic() + deadline_seconds(spec.queue, self.settings, spec.params),
            cancel_event=running.cancel_event, on_progress=monitor.on_progress(lease.job_id),
            on_plan=monitor.on_plan(lease.job_id),
            default_block_size=getattr(self.engine, "default_block_size", None),
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
        # Final counters from the outcome (the last block may finish after the last report), never
        # below what the job showed while running: SQL's progress ends where the hot status did.
        usage = (outcome.result or {}).get("usage") or {}
        final = monitor.final_progress(running, steps_used=outcome.steps_used, tokens=outcome.tokens,
                                            blocks=usage.get("blocks"),
                                            complete=outcome.status is JobStatus.SUCCEEDED)
        with self.sessions() as session:
            written = finish_job(session, lease=lease, status=outcome.status, settings=self.settings,
                                 result=outcome.result, steps_used=outcome.steps_used,
                                 error_code=outcome.error_code, error_message=outcome.error_message,
                                 progress=final)
        running.status = outcome.status.value if written else running.status
        if written and outcome.result is not None and "text" in outcome.result:
            running.extra["partial_text"] = outcome.result["text"]
        self._final_hot_status(running, outcome.status.value if written else "lost")
        if written:  # long-pollers (after the final hot status), webhooks, summary line, metrics
            publish_finished(self.redis, lease.job_id)
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
            publish_finished(self.redis, lease.job_id)
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
            request_id=facts.request_id, logger=log, track=self.info.stats.get("lane"),
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
