"""Serve ``served_model``'s version for this worker's track: load it at start, switch when it changes.

The protocol (turns, drain, load, resume) is described in ``worker/model_switch_protocol.py``, which holds
its parts (``ModelFollower``, ``SwitchTurn``, ``JobsInFlight``); this class carries it out on the
worker's ``ResidentModel``. Consumers are not switched here: the switch only tells the consumer
controller (``worker/consumers.py``) that it is switching or which lane it is on, and the
controller works out what that means next to the drain flags and the gates.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import redis
import structlog
from sqlalchemy.orm import Session, sessionmaker

from scheduler.fleet.workers import WorkerInfo, WorkerState
from scheduler.infra.gc_freeze import freeze_startup_heap
from scheduler.infra.settings import Settings
from scheduler.model_versions.canary_routing import served_target
from scheduler.model_versions.registry import (
    Activation,
    active_version,
    ensure_active,
    register_version,
    store_path,
)
from scheduler.observability.metric_families import set_process_version, version_label
from worker.consumers import ConsumerController
from worker.model_switch_protocol import SWITCHING, JobsInFlight, ModelFollower, SwitchTurn
from worker.resident_model import ResidentModel

log = structlog.get_logger(__name__)


def quietly(action: Callable[[], object]) -> None:
    """Registry and bookkeeping writes during a switch: a Redis or SQL hiccup is logged and
    the switch goes on (the next heartbeat publishes again)."""
    try:
        action()
    except Exception as exc:
        log.warning("worker.model_switch_write_failed", action=getattr(action, "__name__", "?"),
                    error=f"{type(exc).__name__}: {exc}")


class ModelSwitcher:
    """Loads, switches and re-lanes the served model of one worker (see the module docstring)."""

    def __init__(
        self,
        *,
        settings: Settings,
        model_name: str,
        sessions: sessionmaker[Session],
        redis_client: redis.Redis,
        worker_id: str,
        info: WorkerInfo,
        model: ResidentModel,
        consumers: ConsumerController,
        in_flight: JobsInFlight,
        read_drained: Callable[[], frozenset[str] | None],
        stopping: Callable[[], bool],
        heartbeat: Callable[[], None],
        publish_now: Callable[[], object],
        engine_died: Callable[[], None],
    ) -> None:
        """``read_drained``: the drain flags now (None: unreadable); ``stopping``: SIGTERM came;
        ``publish_now``: a metrics snapshot at once; ``engine_died``: no model left, fail."""
        self.settings = settings
        self.model_name = model_name
        self.sessions = sessions
        self.redis = redis_client
        self.worker_id = worker_id
        self.info = info
        self.model = model
        self.consumers = consumers
        self.in_flight = in_flight
        self._read_drained = read_drained
        self._stopping = stopping
        self._heartbeat = heartbeat
        self._publish_now = publish_now
        self._engine_died = engine_died

    @property
    def canary_lane(self) -> bool:
        return self.consumers.state.canary_lane

    # --- start ------------------------------------------------------------------------------------
    def load_initial(self) -> None:
        """At start: load the version this worker's track serves and record it in SQL."""
        activation = self._initial_activation()
        version, on_lane = served_target(stable=activation.version, canary=activation.canary_version,
                                         track=self.settings.canary.track)
        self.model.load(self.store_path(version))
        self.model.model_name = self.model_name
        self.model.served_version = version
        self.set_lane(on_lane)
        self.register_loaded()

    def follower(self) -> ModelFollower:
        """The watcher thread that calls ``switch_model`` / ``move_lane`` (started once ready)."""
        return ModelFollower(
            model_name=self.model_name, sessions=self.sessions,
            turn=SwitchTurn(self.redis, model_name=self.model_name, worker_id=self.worker_id),
            interval=self.settings.model.watch_interval_seconds,
            current=lambda: self.model.served_version, switch=self.switch_model,
            track=self.settings.canary.track, current_lane=lambda: self.canary_lane, move_lane=self.move_lane,
        )

    def store_path(self, version: str) -> Path:
        return store_path(self.settings.resolved_model_root, self.model_name, version)

    def _initial_activation(self) -> Activation:
        """The version to load at start: the active one, else ``served_model_initial_version``
        (which becomes active when no version is)."""
        name = self.model_name
        with self.sessions() as session:
            current = active_version(session, name=name)
            if current is not None:
                return current
            initial = self.settings.model.served_initial_version
            if not initial:
                raise RuntimeError(f"model {name!r} has no active version: run `cloverq model activate "
                                   f"{name} VERSION` or set CLOVERQ_SERVED_MODEL_INITIAL_VERSION")
            return ensure_active(session, name=name, version=initial, path=self.store_path(initial))

    def register_loaded(self) -> None:
        """Record the served version in SQL (idempotent), so the admin API lists it."""
        assert self.model.served_version
        with self.sessions() as session:
            register_version(session, name=self.model_name, version=self.model.served_version,
                             path=self.store_path(self.model.served_version))

    # --- canary lanes (scheduler/model_versions/canary_routing.py) ---
    def set_lane(self, on_lane: bool) -> None:
        """Serve on the canary lanes or the plain queues (the registry, the metrics, the consumers)."""
        lane = "canary" if on_lane else "stable"
        self.info.set_stats(lane=lane)
        set_process_version(version_label(self.model.model_version), lane)
        self.consumers.update(canary_lane=on_lane, wait=True)

    def move_lane(self, on_lane: bool) -> None:
        """Same version, other lane (a promotion leaves a canary worker on its version): move the
        consumers only. The claim's version check is the guarantee; consumers are delivery."""
        self.set_lane(on_lane)
        quietly(self._heartbeat)
        log.info("worker.lane_moved", lane=self.info.stats["lane"], version=self.model.served_version)

    # --- switch -----------------------------------------------------------------------------------
    def switch_model(self, activation: Activation) -> bool:
        """Drain, load ``activation``'s version, warm up, take jobs again (module doc of
        worker/model_switch_protocol.py). Returns False (still serving the old version) if it cannot load.
        ``activation.version`` is the version this worker's track serves (``ModelFollower``): on
        the canary lanes when it is the canary version."""
        target = self.store_path(activation.version)
        if not (target / "manifest.json").is_file():
            log.error("worker.model_switch_missing", version=activation.version, path=str(target))
            self.info.set_stats(model_switch_error=f"{activation.version}: not in the store at {target}")
            return False
        if self._stopping():
            return False
        began = time.monotonic()
        old_version = self.model.model_version
        log.info("worker.model_switch_started", version=activation.version, previous=old_version)
        self.info.state = SWITCHING
        outcome: bool | None = False
        try:
            quietly(self._heartbeat)
            self.consumers.update(switching=True, wait=True)
            self.in_flight.close_and_wait()  # every claimed job finishes on the old version
            outcome = self._swap_engine(activation.version)
            if outcome:
                self.set_lane(activation.version == activation.canary_version)
        finally:  # whatever happened, a worker with a model takes jobs again
            if outcome is not None:
                self._resume()
        if outcome:
            self.info.drop_stat("model_switch_error")
            quietly(self.register_loaded)
        seconds = round(time.monotonic() - began, 3)
        self.info.set_stats(model_switch_seconds=seconds)
        log.info("worker.model_switched" if outcome else "worker.model_switch_abandoned",
                 version=self.model.model_version, previous=old_version, seconds=seconds)
        return bool(outcome)

    def _swap_engine(self, version: str) -> bool | None:
        """Stop the drained engine, load ``version``; on failure reload the served one.
        True: switched; False: still on the old version; None: no model left (worker fails)."""
        previous = self.model.served_version
        self.model.unload()  # frees the old weights before the new ones load
        try:
            self.model.load(self.store_path(version))
            self.model.served_version = version
            freeze_startup_heap()
            return True
        except Exception as exc:  # corrupt or unloadable version: go back to the one we had
            log.error("worker.model_switch_failed", version=version, error=repr(exc))
            self.info.set_stats(model_switch_error=f"{version}: {exc!r}"[:500])
        try:
            assert previous is not None
            self.model.load(self.store_path(previous))
            return False
        except Exception as again:
            log.error("worker.model_reload_failed", version=previous, error=repr(again))
            self._engine_died()
            return None

    def _resume(self) -> None:
        """Take jobs again: the in-flight count first (the guarantee), then the registry and consumers."""
        self.in_flight.open()
        if self._stopping():  # SIGTERM arrived meanwhile: the registry says draining, keep it so
            return
        self.info.state = WorkerState.READY
        self.consumers.update(switching=False, drained=self._read_drained(), wait=True)
        quietly(self._heartbeat)
        quietly(self._publish_now)
