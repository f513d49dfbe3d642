"""The model switch protocol and its parts: follow the active model version, notice a change,
drain, load, warm up, take jobs again. ``worker/model_switcher.py`` ``ModelSwitcher`` carries it
out on the worker's model.

A worker started with ``served_model`` serves ``<model_root>/<served_model>/<active version>``
and a ``ModelFollower`` thread polls the active version in SQL (``scheduler.model_versions.registry``)
every ``model_watch_interval_seconds``. When it changes the worker
(``worker/model_switcher.py`` ``ModelSwitcher.switch_model``):

1. waits for its turn: one worker per model switches at a time (a Redis lock), so a fleet of
   several workers never loses all its capacity at once (no downtime while it rolls);
2. stops taking jobs: its Celery consumers are cancelled (the consumer controller,
   ``worker/consumers.py``, consumes nothing while switching) and ``JobsInFlight`` closes, so a
   message that was already delivered is handed back unclaimed (the reconciler republishes it);
3. drains: every job it had claimed finishes on the old version (none is interrupted or retried);
4. unloads the old model, loads and verifies the new folder, warms the engine up;
5. reports ``ready`` with the new version, consumes again, and passes the turn on.

Every job records the version it ran on at claim time (``Job.model_version``), and no job is
claimed while a switch is under way, so that record is exact.

Canaries (``scheduler/model_versions/canary.py``): the version a worker should serve depends on its
``model_track``. A ``canary`` worker serves the canary version while one is in effect and then
consumes the canary lanes (``canary.<queue>``); otherwise it serves the active version like a
``stable`` worker (``scheduler.model_versions.canary_routing.served_target``). A promotion that
leaves a canary worker on the same version only moves its consumers back to the plain queues (no reload).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

import redis
import structlog
from sqlalchemy.orm import Session, sessionmaker

from scheduler.infra import redis_keys
from scheduler.model_versions.canary_routing import served_target
from scheduler.model_versions.registry import Activation, active_version

log = structlog.get_logger(__name__)

SWITCHING = "switching"  # registry state while a worker drains and loads another version
TURN_TTL_SECONDS = 3600  # backstop only: a dead holder's turn is taken over at once (see take)


class JobsInFlight:
    """Counts the jobs inside ``run_job``; closing it refuses new ones and waits for the rest."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self._open = True

    def enter(self) -> bool:
        """Admit one job, or refuse it while closed (the caller hands its message back)."""
        with self._cond:
            if not self._open:
                return False
            self._inside += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._inside -= 1
            self._cond.notify_all()

    def close_and_wait(self, timeout: float | None = None) -> bool:
        """Refuse new jobs and wait until the admitted ones left; False on timeout."""
        with self._cond:
            self._open = False
            return self._cond.wait_for(lambda: self._inside == 0, timeout=timeout)

    def open(self) -> None:
        with self._cond:
            self._open = True

    @property
    def inside(self) -> int:
        return self._inside


# KEYS[1] = turn key, ARGV[1] = expected holder: delete only if still ours.
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# KEYS[1] = turn key, ARGV[1] = dead holder, ARGV[2] = new holder, ARGV[3] = ttl.
_TAKE_OVER = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "redis.call('set', KEYS[1], ARGV[2], 'EX', ARGV[3]) return 1 end return 0"
)


def turn_key(model_name: str) -> str:
    return redis_keys.model_switch_turn(model_name)


class SwitchTurn:
    """One worker of a model switches at a time (Redis lock holding the worker id).

    A holder whose registry entry expired (the process died mid-switch) loses the turn to the
    next worker that asks.
    """

    def __init__(self, client: redis.Redis, *, model_name: str, worker_id: str) -> None:
        self.client = client
        self.key = turn_key(model_name)
        self.worker_id = worker_id

    def take(self) -> bool:
        if self.client.set(self.key, self.worker_id, nx=True, ex=TURN_TTL_SECONDS):
            return True
        holder = self.client.get(self.key)
        if holder is None:
            return bool(self.client.set(self.key, self.worker_id, nx=True, ex=TURN_TTL_SECONDS))
        holder = holder.decode() if isinstance(holder, bytes) else str(holder)
        if holder == self.worker_id:
            return True
        if self.client.exists(redis_keys.worker(holder)):
            return False  # a live worker is switching: wait for the next poll
        log.warning("worker.model_switch_turn_taken_over", dead_holder=holder)
        return bool(self.client.eval(_TAKE_OVER, 1, self.key, holder, self.worker_id, TURN_TTL_SECONDS))

    def release(self) -> None:
        self.client.eval(_RELEASE, 1, self.key, self.worker_id)


class ModelFollower:
    """The watcher thread: polls the active version and asks the runtime to switch to it."""

    def __init__(
        self,
        *,
        model_name: str,
        sessions: sessionmaker[Session],
        turn: SwitchTurn,
        interval: float,
        current: Callable[[], str | None],
        switch: Callable[[Activation], bool],
        track: str = "stable",
        current_lane: Callable[[], bool] | None = None,
        move_lane: Callable[[bool], None] | None = None,
    ) -> None:
        """``switch`` gets the activation with ``version`` set to the version this worker's
        ``track`` serves; ``move_lane(on_canary_lane)`` changes consumers only (same version)."""
        self.model_name = model_name
        self.track = track
        self._current_lane = current_lane
        self._move_lane = move_lane
        self.sessions = sessions
        self.turn = turn
        self.interval = interval
        self._current = current
        self._switch = switch
        self._failed_generation: int | None = None  # do not retry a version that failed to load
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start watching (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="cloverq-model-follower", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check_once()
            except Exception as exc:  # database or Redis hiccup: keep serving, try again later
                log.warning("worker.model_watch_failed", error=f"{type(exc).__name__}: {exc}")

    def check_once(self) -> bool:
        """One poll: switch if the active version differs from the served one; True if switched."""
        with self.sessions() as session:
            wanted = active_version(session, name=self.model_name)
        if wanted is None:
            return False
        version, on_lane = served_target(stable=wanted.version, canary=wanted.canary_version,
                                         track=self.track)
        wanted = replace(wanted, version=version)
        if version == self._current():
            lane_now = self._current_lane() if self._current_lane is not None else on_lane
            if lane_now != on_lane and self._move_lane is not None:
                self._move_lane(on_lane)  # promoted: same weights, plain queues again
            return False
        if wanted.generation == self._failed_generation:
            return False
        if not self.turn.take():
            log.info("worker.model_switch_waiting_turn", version=wanted.version)
            return False
        try:
            if self._stop.is_set():
                return False
            switched = self._switch(wanted)
            if not switched:
                self._failed_generation = wanted.generation
            return switched
        finally:
            self.turn.release()

