"""The worker runtime: one per worker process, the composition of its parts.

Each part holds one concept and is typed against the others' small surfaces:

- ``worker/resident_model.py`` ``ResidentModel``: the checkpoint, its engine (typed by
  ``worker/engine_protocol.py`` ``ServingEngine``), tokenizer and version labels;
- ``worker/process_lifecycle.py`` ``ProcessLifecycle``: start, ready, heartbeat, draining, stop;
- ``worker/model_switcher.py`` ``ModelSwitcher``: the served version at start, switches, lanes
  (only with ``served_model``);
- ``worker/job_runner.py`` ``JobRunner``: ``run_job``, what the Celery task calls from a pool
  thread: hand back, fenced claim -> engine -> fenced outcome;
- ``worker/consumers.py`` ``ConsumerController``: the one place that decides (``consumed_queues``)
  and changes which Celery queues this worker consumes; the gates (``worker/class_gates.py``),
  the drain follower (``worker/queue_drain.py``), the switcher and the lifecycle only tell it
  what changed;
- ``worker/fault_injection.py``: test-only faults, handed to the runner only when
  ``settings.worker.fault_injection`` is on.

``WorkerRuntime`` builds them and exposes what ``worker/celery_worker.py`` and ``worker/tasks.py``
call; it has no logic of its own.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from opentelemetry.context import Context

from scheduler.fairness import gate as fair_share
from scheduler.fairness.kicker import ReleaseKicker
from scheduler.fleet.workers import WorkerInfo, WorkerState
from scheduler.infra.celery_app import get_celery_app
from scheduler.infra.db import get_session_factory
from scheduler.infra.redis_client import get_redis
from scheduler.infra.settings import Settings
from scheduler.observability.metrics_recorder import RedisMetricsRecorder
from worker.class_gates import JOINT_QUEUE, ClassGate, interactive_reserve
from worker.consumers import AmqpQueues, CeleryConsumer, ConsumerController
from worker.engine_protocol import ServingEngine
from worker.fault_injection import fault_injector_for
from worker.job_runner import JobRunner
from worker.model_switch_protocol import JobsInFlight
from worker.model_switcher import ModelSwitcher
from worker.monitor import JobMonitor
from worker.process_lifecycle import ProcessLifecycle
from worker.queue_drain import DrainFollower
from worker.resident_model import ResidentModel
from worker.run_outcome import RunOutcome

KICK_PASSES = 8  # release passes per kick (more requests wait for the next kick or the beat tick)


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
                               heartbeat_seconds=settings.worker.heartbeat_seconds)
        self.info.set_stats(model_track=settings.canary.track, served_model=settings.model.served)
        self.metrics = RedisMetricsRecorder(self.redis)  # job outcomes and snapshots (worker/telemetry.py)
        # Switches this worker's Celery consumer in process, read back and healed each heartbeat.
        self.consumers = ConsumerController(
            queues, stale_after_seconds=5 * settings.worker.heartbeat_seconds + 5.0,
            on_heal=self._consumer_healed)
        self.drain_follower = DrainFollower(redis_client=self.redis, controller=self.consumers,
                                            node=self.worker_id)
        # Every class but interactive holds at most engine_max_batch task threads (and engine slots);
        # the engine_interactive_reserve beyond are interactive's alone (issue 15: short first).
        reserve = interactive_reserve(queues, settings.engine.interactive_reserve)
        self.model = ResidentModel(settings, info=self.info, worker_id=self.worker_id,
                                   redis_client=self.redis, reserve=reserve)
        self.in_flight = JobsInFlight()  # closed while a model switch drains and loads
        monitor = JobMonitor(settings=settings, sessions=self.sessions, redis_client=self.redis,
                             worker_id=self.worker_id, decode=self.model.decode, heartbeat=self._heartbeat)
        draining = threading.Event()
        # Fair share: each message taken frees room in its class's list for the next held job, released
        # by DRR on this background thread (scheduler/fairness/kicker.py), never on a task thread.
        self.fair_release = ReleaseKicker(self._release_held) if fair_share.enabled(settings) else None
        self.lifecycle = ProcessLifecycle(
            settings=settings, worker_id=self.worker_id, queues=queues, info=self.info,
            redis_client=self.redis, model=self.model, monitor=monitor, metrics=self.metrics,
            consumers=self.consumers, drain=self.drain_follower, draining=draining,
        )
        if settings.model.served:
            self.lifecycle.switcher = ModelSwitcher(
                settings=settings, model_name=settings.model.served, sessions=self.sessions,
                redis_client=self.redis, worker_id=self.worker_id, info=self.info, model=self.model,
                consumers=self.consumers, in_flight=self.in_flight, read_drained=self.drain_follower.read,
                stopping=draining.is_set, heartbeat=self._heartbeat,
                publish_now=self.lifecycle.publish_metrics_now, engine_died=self.lifecycle.engine_died,
            )
        # At most engine_joint_slot_cap joint jobs hold task threads (worker/class_gates.py); at most
        # engine_max_batch of every class but interactive. A full gate pauses its queues (consumers).
        # A gate records its change under its lock and sends the consumer commands after it.
        joint_gate = ClassGate(settings.engine.joint_slot_cap, name=JOINT_QUEUE,
                               on_full=lambda full: self.consumers.record(joint_full=full),
                               then=self.consumers.sync)
        capacity_gate = ClassGate(settings.engine.max_batch, name="capacity",
                                  on_full=lambda full: self.consumers.record(capacity_full=full),
                                  then=self.consumers.sync)
        self.runner = JobRunner(
            settings=settings, sessions=self.sessions, redis_client=self.redis, worker_id=self.worker_id,
            model=self.model, monitor=monitor, metrics=self.metrics, in_flight=self.in_flight,
            joint_gate=joint_gate if JOINT_QUEUE in queues else None,
            capacity_gate=capacity_gate if reserve else None,
            draining=draining, lane=lambda: self.info.stats.get("lane"), faults=fault_injector_for(settings),
            on_message=self.fair_release.kick if self.fair_release is not None else None,
        )

    def _release_held(self, queue: str) -> int:
        releaser = fair_share.releaser(self.settings, get_celery_app(), self.redis, self.sessions)
        return fair_share.release_quietly(releaser, queue, max_passes=KICK_PASSES)

    def _consumer_healed(self, queue: str) -> None:
        self.metrics.safe(self.metrics.consumer_healed, queue=queue)

    def _heartbeat(self) -> None:
        self.lifecycle.heartbeat()

    # --- what worker/celery_worker.py and worker/tasks.py call ----------------------------------
    def start(self) -> None:
        self.lifecycle.start()

    def select_queues_at_start(self, queues: AmqpQueues) -> list[str]:
        return self.lifecycle.select_queues_at_start(queues)

    def mark_ready(self, consumer: Any) -> None:
        """``consumer``: Celery's ``Consumer`` (the ``worker_ready`` signal's sender)."""
        self.lifecycle.mark_ready(CeleryConsumer(consumer))

    def mark_draining(self) -> None:
        self.lifecycle.mark_draining()

    def stop(self) -> None:
        self.lifecycle.stop()

    def heartbeat(self) -> None:
        self.lifecycle.heartbeat()

    def run_job(self, job_id: str, *, queue: str | None = None,
                trace_parent: Context | None = None) -> RunOutcome:
        return self.runner.run_job(job_id, queue=queue, trace_parent=trace_parent)

    # --- read-only views (registry, tests) -------------------------------------------------------
    @property
    def engine(self) -> ServingEngine | None:
        return self.model.engine

    @property
    def model_version(self) -> str | None:
        return self.model.model_version

    @property
    def served_version(self) -> str | None:
        return self.model.served_version

    @property
    def canary_lane(self) -> bool:
        return self.consumers.state.canary_lane


_runtime: WorkerRuntime | None = None


def set_runtime(runtime: WorkerRuntime | None) -> None:
    global _runtime
    _runtime = runtime


def get_runtime() -> WorkerRuntime:
    if _runtime is None:
        raise RuntimeError("the worker runtime is not started (run through worker.celery_worker)")
    return _runtime
