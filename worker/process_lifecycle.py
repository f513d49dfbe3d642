"""The worker process's life: start (load, warm up), ready, heartbeat, draining, stop.

Celery's signals drive it (``worker/celery_worker.py``): ``worker_init`` -> ``start`` and the
start-up queue selection; ``worker_ready`` -> ``mark_ready``; ``worker_shutting_down``
(SIGTERM) -> ``mark_draining``; ``worker_shutdown`` -> ``stop``. The model is loaded ONCE, in
``start``, and the process reports ready only after the engine warmed up, so no job is taken
before the model is resident. Nothing here forks, so CUDA is initialised in the process that
uses it (threads pool; docs/architecture.md §3.6).

The heartbeat (from the monitor thread) publishes the registry entry, notices a dead engine
and feeds the drain flags to the consumer controller.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import redis
import structlog
import torch

from scheduler.fleet.workers import WorkerInfo, WorkerState, heartbeat_ttl, publish_worker, remove_worker
from scheduler.infra.gc_freeze import freeze_startup_heap
from scheduler.infra.settings import Settings
from scheduler.observability.metrics_recorder import RedisMetricsRecorder, WorkerSnapshot
from worker.consumers import AmqpQueues, ConsumerController, ConsumerHandle
from worker.model_switch_protocol import ModelFollower
from worker.model_switcher import ModelSwitcher
from worker.monitor import JobMonitor
from worker.queue_drain import DrainFollower
from worker.resident_model import ResidentModel
from worker.telemetry import TelemetryThread, snapshot_from_stats

log = structlog.get_logger(__name__)


class ProcessLifecycle:
    """Start, readiness, heartbeat, draining and stop of one worker process."""

    def __init__(
        self,
        *,
        settings: Settings,
        worker_id: str,
        queues: tuple[str, ...],
        info: WorkerInfo,
        redis_client: redis.Redis,
        model: ResidentModel,
        monitor: JobMonitor,
        metrics: RedisMetricsRecorder,
        consumers: ConsumerController,
        drain: DrainFollower,
        draining: threading.Event,
    ) -> None:
        """``draining`` is shared with the job runner (set: hand every message back)."""
        self.settings = settings
        self.worker_id = worker_id
        self.queues = queues
        self.info = info
        self.redis = redis_client
        self.model = model
        self.monitor = monitor
        self.metrics = metrics
        self.consumers = consumers
        self.drain = drain
        self.draining = draining
        self.ready = threading.Event()
        self.switcher: ModelSwitcher | None = None  # with served_model (set by the runtime)
        self.follower: ModelFollower | None = None
        self.telemetry: TelemetryThread | None = None

    def start(self) -> None:
        """Load the model, start and warm the engine, start the monitor (blocks until done)."""
        self.heartbeat()
        torch.set_num_threads(self.settings.resolved_torch_threads)  # before the model's first op
        began = time.monotonic()
        if self.switcher is not None:  # follow the active version in SQL (worker/model_switch_protocol.py)
            self.switcher.load_initial()
        else:
            loaded = self.model.load(self.settings.resolved_model_dir)
            self.model.model_name = loaded.path.name
        self.info.set_stats(model_load_seconds=round(time.monotonic() - began, 3))
        self.telemetry = TelemetryThread(self.metrics, self.metrics_snapshot,
                                         interval=self.settings.observability.worker_metrics_interval)
        self.telemetry.start()
        self.monitor.start()
        if self.switcher is not None:  # started by mark_ready, once Celery consumes
            self.follower = self.switcher.follower()
        log.info("worker.loaded", worker_id=self.worker_id, model_version=self.model.model_version,
                 seconds=self.info.stats["model_load_seconds"])

    def select_queues_at_start(self, queues: AmqpQueues) -> list[str]:
        """On ``worker_init``, after ``start`` and before the consumer exists: consume exactly
        what the controller's state says (``queues``: the app's ``amqp.queues``)."""
        drained = self.drain.read()
        if drained is not None:
            self.consumers.update(drained=drained)
        return self.consumers.select_at_start(queues)

    def mark_ready(self, consumer: ConsumerHandle) -> None:
        freeze_startup_heap()  # the model and the libraries stay: keep full GCs short
        self.info.state = WorkerState.READY
        self.ready.set()
        self.consumers.go_live(consumer)  # the consumer exists: it follows the state from now on
        self.heartbeat()
        if self.telemetry is not None:
            self.telemetry.publish_now()  # the dashboard sees the worker as ready at once
        if self.follower is not None:  # watch the active version only once consumers exist
            self.follower.start()

    def mark_draining(self) -> None:
        """SIGTERM: the consumer stops taking jobs; running ones finish; say so in the registry.

        Celery cancels its consumer only a moment later; a message delivered in between is handed
        back unclaimed (``JobRunner.run_job``).
        """
        self.draining.set()
        self.consumers.record(stopping=True)  # nothing to send once stopping
        if self.info.state != WorkerState.FAILED:
            self.info.state = WorkerState.DRAINING
        self.heartbeat()
        log.info("worker.draining", worker_id=self.worker_id)

    def stop(self) -> None:
        """After the pool drained: stop the engine (finishing anything left), leave the registry."""
        self.info.state = WorkerState.STOPPED
        if self.follower is not None:
            self.follower.stop()
        if self.model.engine is not None:
            self.model.engine.stop(drain=True, timeout=30)
        self.monitor.stop()
        if self.telemetry is not None:
            self.telemetry.stop()
        remove_worker(self.redis, self.worker_id)
        log.info("worker.stopped", worker_id=self.worker_id)

    def heartbeat(self) -> None:
        engine = self.model.engine  # a model switch replaces it; read it once
        if engine is not None:
            stats = engine.stats()
            if not stats.running and self.info.state == WorkerState.READY and engine is self.model.engine:
                self.engine_died()
            self.info.set_stats(running_jobs=self.monitor.running_count(),
                                batch_occupancy=stats.batch_occupancy,
                                tokens_per_second=round(stats.tokens_per_second, 2),
                                engine_passes=stats.passes,
                                engine_busy_seconds=round(stats.busy_seconds, 3))
        # What the Celery consumer itself consumes (read back by the last reconcile), and what it
        # should but does not: /readyz and cloverq_workers_queue_unconsumed read these.
        self.info.set_stats(consuming=sorted(self.consumers.consuming),
                            unconsumed=self.consumers.unconsumed())
        ttl = heartbeat_ttl(self.settings.worker.heartbeat_seconds)
        publish_worker(self.redis, self.info, ttl_seconds=ttl)  # snapshot and write under one lock
        self.drain.sync()
        self.consumers.heal()  # read the consumer back and put right whatever differs

    def engine_died(self) -> None:
        """The engine thread is gone: stop advertising readiness, hand back what arrives, and ask
        Celery for a warm shutdown so the process supervisor restarts a healthy worker."""
        log.error("worker.engine_dead", worker_id=self.worker_id)
        self.info.state = WorkerState.FAILED
        self.draining.set()
        self.consumers.record(stopping=True)  # nothing to send once stopping
        os.kill(os.getpid(), signal.SIGTERM)

    def publish_metrics_now(self) -> None:
        """One metrics snapshot at once (after a model switch), when telemetry runs."""
        if self.telemetry is not None:
            self.telemetry.publish_now()

    def metrics_snapshot(self) -> WorkerSnapshot:
        engine = self.model.engine
        return snapshot_from_stats(
            engine.stats() if engine is not None else None, worker_id=self.worker_id,
            device=self.settings.model.device, queues=self.queues, state=self.info.state,
            model_name=self.model.model_name, model_version=self.model.model_version,
            model_load_seconds=self.info.stats.get("model_load_seconds"),
            track=self.info.stats.get("lane"),
        )
