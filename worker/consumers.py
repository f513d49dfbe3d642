"""Which Celery queues this worker consumes: one pure rule, one controller that applies it.

Several things decide whether a worker should take messages from a queue, and they used to
switch Celery consumers on and off separately, kept apart by precedence checks ("resume joint
unless an operator drained it", "re-add after a switch minus the drained queues", ...):

- the configured queues (``celery worker --queues``);
- the operator's drain flags (``scheduler.fleet.queue_drain``; followed by ``worker/queue_drain.py``);
- a model switch (``worker/model_switcher.py``): while it drains and loads, nothing;
- the joint gate: at ``engine_joint_slot_cap`` joint jobs, no ``joint`` (``worker/class_gates.py``);
- the capacity gate: at ``engine_max_batch`` non-interactive jobs, no ``standard``/``bulk`` (the
  threads beyond are the interactive reserve; ``joint`` is the joint gate's alone);
- the canary lane: a worker serving the canary version consumes ``canary.<queue>`` instead of
  ``<queue>`` (``scheduler/model_versions/canary_routing.py``);
- shutdown: after SIGTERM Celery stops the consumer itself; nothing is added again.

``consumed_queues`` turns that state into the set of Celery queue names, with no I/O, so every
combination is a table row in ``tests/unit/test_worker_consumers.py``. ``ConsumerController``
holds the state and makes the Celery consumer match it *in process*, level-triggered: one
idempotent callback on the consumer's own thread reads the newest state and the queues the
consumer itself consumes, cancels and adds the difference, and reads the result back.

Why not remote control (what this module did before issue 31): Celery's ``add_consumer`` and
``cancel_consumer`` commands, even addressed to one's own node, are each run through
``consumer.call_soon``; with the event loop (``kombu.asynchronous.Hub``) pending callbacks are
kept in a ``set`` and run in hash order, so commands that arrive in one loop iteration (a gate
filling and freeing within milliseconds: cancel, cancel, add, add) run in any order. An add that
ran before its cancel was a no-op (still consuming), the cancel then stopped the queue, and the
controller, which had recorded both as applied, never knew: workers sat on ``interactive`` and
``joint`` for minutes with thousands of bulk messages waiting. A reconciler that converges to
the newest state whatever order its calls run in, that reads what the consumer really consumes
and that runs again at every heartbeat cannot drift that way; a difference it finds that it did
not cause is logged and counted (``cloverq_worker_consumer_heals_total``), and the registry
publishes what the consumer consumes, so ``/readyz`` and ``cloverq_workers_queue_unconsumed``
tell the truth.

Consumers are delivery, never the guarantee: a message that slips in before a cancel takes
effect is handed back unclaimed by the job runner (gates, ``JobsInFlight``, draining), and the
claim's version check keeps a job off the wrong model version whatever queue carried it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypedDict, Unpack

import structlog

from scheduler.model_versions.canary_routing import lane_names
from worker.class_gates import JOINT_QUEUE, PAUSABLE_AT_CAPACITY

log = structlog.get_logger(__name__)

APPLY_TIMEOUT_SECONDS = 5.0  # how long ``sync(wait=True)`` waits for the consumer's thread to apply


@dataclass(frozen=True)
class ConsumerState:
    """Everything that decides what this worker consumes (class queue names, not lanes)."""

    configured: tuple[str, ...]  # priority order, as `celery worker --queues` got them
    drained: frozenset[str] = field(default_factory=frozenset)  # operator-drained (fleet/queue_drain.py)
    switching: bool = False  # a model switch drains and loads: take nothing
    joint_full: bool = False  # the joint gate is at its cap
    capacity_full: bool = False  # the non-interactive classes hold engine_max_batch threads
    canary_lane: bool = False  # serving the canary version: consume canary.<queue>
    stopping: bool = False  # SIGTERM (or a dead engine): take nothing, ever again


def consumed_classes(state: ConsumerState) -> list[str]:
    """The class queues (not lanes) ``state`` consumes, in the configured priority order."""
    if state.stopping or state.switching:
        return []
    paused: set[str] = set(state.drained)
    if state.joint_full:
        paused.add(JOINT_QUEUE)
    if state.capacity_full:
        paused.update(PAUSABLE_AT_CAPACITY)
    return [queue for queue in state.configured if queue not in paused]


def consumed_queues(state: ConsumerState) -> frozenset[str]:
    """The Celery queues a worker in ``state`` consumes (pure; see the module docstring)."""
    return frozenset(lane_names(consumed_classes(state), canary=state.canary_lane))


def ordered_queues(state: ConsumerState) -> list[str]:
    """``consumed_queues(state)`` in the configured priority order."""
    return lane_names(consumed_classes(state), canary=state.canary_lane)


class StateChange(TypedDict, total=False):
    """The parts of a ``ConsumerState`` a caller may change (None: unchanged)."""

    drained: Iterable[str] | None
    switching: bool | None
    joint_full: bool | None
    capacity_full: bool | None
    canary_lane: bool | None
    stopping: bool | None


class ConsumerHandle(Protocol):
    """This worker's Celery consumer. ``call_soon`` may be called from any thread; the others run
    only on the consumer's own thread (inside a ``call_soon`` callback)."""

    def call_soon(self, callback: Callable[[], None]) -> None: ...

    def consuming(self) -> frozenset[str] | None:
        """The queues the consumer consumes now; None while it has none (restarting)."""
        ...

    def add(self, queue: str) -> None: ...

    def cancel(self, queue: str) -> None: ...


class CeleryConsumer:
    """``ConsumerHandle`` over Celery's ``Consumer`` (the ``worker_ready`` signal's sender): the
    same ``add_task_queue`` / ``cancel_task_queue`` that Celery's remote-control commands call,
    but run by our own callback on the consumer's thread instead of one command each."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer

    def call_soon(self, callback: Callable[[], None]) -> None:
        self._consumer.call_soon(callback)

    def consuming(self) -> frozenset[str] | None:
        tasks = self._consumer.task_consumer
        if tasks is None:
            return None
        return frozenset(queue.name for queue in tasks.queues if tasks.consuming_from(queue.name))

    def add(self, queue: str) -> None:
        self._consumer.add_task_queue(queue)

    def cancel(self, queue: str) -> None:
        self._consumer.cancel_task_queue(queue)


class AmqpQueues(Protocol):
    """The part of a Celery app's ``amqp.queues`` used before the consumer starts."""

    @property
    def consume_from(self) -> Any: ...

    def deselect(self, exclude: list[str]) -> None: ...

    def select_add(self, queue: str) -> Any: ...


class ConsumerController:
    """Holds the ``ConsumerState`` and keeps the Celery consumer on ``consumed_queues`` of it.

    ``record`` changes the state under a short lock (a gate calls it under its own lock, so
    changes are recorded in the order they happened) and never blocks on I/O. ``sync`` asks the
    consumer's thread to reconcile (``_reconcile``: one callback queued at a time, coalescing any
    number of changes); ``heal`` does the same at every heartbeat, so a consumer changed behind
    the controller's back (a Celery restart, a stray broadcast) is put right within one
    heartbeat. Because the callback reads the newest state and the consumer's own queues when it
    runs, the order in which the event loop runs its callbacks cannot matter.

    Before ``go_live`` (no consumer yet) changes are only recorded: the start-up selection is made
    on the app's ``amqp.queues`` (``select_at_start``). Once ``stopping``, nothing is changed any
    more (the warm shutdown stops the consumer itself).
    """

    def __init__(self, configured: Sequence[str], *, on_heal: Callable[[str], None] | None = None,
                 stale_after_seconds: float = 10.0) -> None:
        """``on_heal(queue)``: a queue the consumer consumed (or not) against what the controller
        left it with, put right (metrics). ``stale_after_seconds``: a consumer whose queues were
        not read back for this long (its thread stuck) counts as consuming nothing it should."""
        self._state = ConsumerState(configured=tuple(configured))
        self._consuming: frozenset[str] = frozenset(self._state.configured)  # as last read back
        self._checked_at = time.monotonic()
        self._handle: ConsumerHandle | None = None
        self._on_heal = on_heal
        self._stale_after = stale_after_seconds
        self._requested = 0  # sync requests so far
        self._done = 0  # the newest request a finished reconcile covered
        self._scheduled = False  # a reconcile callback is queued and has not started
        self._loop_thread: int | None = None
        # Re-entrant: Celery runs its SIGTERM handler (``mark_draining`` -> ``record``) on the main
        # thread, which may be inside ``go_live`` or ``select_at_start`` at that moment.
        self._lock = threading.RLock()
        self._applied = threading.Condition(self._lock)

    @property
    def state(self) -> ConsumerState:
        return self._state

    @property
    def consuming(self) -> frozenset[str]:
        """The Celery queues the consumer consumed when last read back (before ``go_live``: the
        start-up selection)."""
        return self._consuming

    def unconsumed(self) -> list[str]:
        """Queues the state wants that the consumer does not consume, as far as can be told: all
        of them while the consumer's queues have not been read back for ``stale_after_seconds``
        (its thread does not answer). Empty before ``go_live`` and once stopping."""
        with self._lock:
            if self._handle is None or self._state.stopping:
                return []
            wanted = ordered_queues(self._state)
            if time.monotonic() - self._checked_at > self._stale_after:
                return wanted
            return [name for name in wanted if name not in self._consuming]

    def record(self, **changes: Unpack[StateChange]) -> None:
        """Change the named parts of the state (None: unchanged); changes no consumer (``sync``)."""
        values: dict[str, Any] = {name: value for name, value in changes.items() if value is not None}
        if "drained" in values:
            values["drained"] = frozenset(values["drained"])
        with self._lock:
            self._state = replace(self._state, **values)

    def update(self, *, wait: bool = False, **changes: Unpack[StateChange]) -> None:
        """``record`` the changes, then ``sync``."""
        self.record(**changes)
        self.sync(wait=wait)

    def sync(self, *, wait: bool = False) -> None:
        """Have the consumer's thread apply the newest state. ``wait``: until it did (a model switch
        wants its consumers gone before it drains), at most ``APPLY_TIMEOUT_SECONDS``."""
        with self._lock:
            handle = self._handle
            if handle is None or self._state.stopping:
                return
            self._requested += 1
            target = self._requested
            on_loop = threading.get_ident() == self._loop_thread
            schedule = not self._scheduled and not on_loop
            self._scheduled = self._scheduled or schedule
        if on_loop:  # already on the consumer's thread (a control command): apply now
            self._reconcile()
            return
        if schedule:
            try:
                handle.call_soon(self._reconcile)
            except Exception as exc:  # the next sync or heartbeat tries again
                log.warning("worker.consumer_sync_failed", error=f"{type(exc).__name__}: {exc}")
                with self._lock:
                    self._scheduled = False
                return
        if wait:
            with self._applied:
                if not self._applied.wait_for(lambda: self._done >= target, timeout=APPLY_TIMEOUT_SECONDS):
                    log.warning("worker.consumer_sync_timeout", seconds=APPLY_TIMEOUT_SECONDS)

    def heal(self) -> None:
        """Read the consumer's queues back and put right what differs (the heartbeat calls this)."""
        self.sync()

    def go_live(self, handle: ConsumerHandle) -> None:
        """Celery's consumer runs (``worker_ready``): from now on it follows the state."""
        with self._lock:
            self._handle = handle
            self._checked_at = time.monotonic()
        self.sync()

    def select_at_start(self, queues: AmqpQueues) -> list[str]:
        """On ``worker_init``, before any consumer exists: select exactly the queues the state
        consumes on the app's ``amqp.queues`` (drained queues never consumed at all, a canary
        worker on its lanes from its first message on). Returns them in priority order."""
        with self._lock:
            wanted = ordered_queues(self._state)
            everything = self._universe()
            current = set(queues.consume_from)
            stale = [name for name in everything if name in current and name not in wanted]
            if stale:
                queues.deselect(stale)
            for name in wanted:
                if name not in current:
                    queues.select_add(name)
            self._consuming = frozenset(wanted)
        if stale or set(wanted) - current:
            log.info("worker.queues_selected_at_start", queues=wanted, deselected=stale)
        return wanted

    def _universe(self) -> list[str]:
        """Every Celery queue this worker could consume: its classes and their canary lanes."""
        return [*self._state.configured, *lane_names(self._state.configured, canary=True)]

    def _reconcile(self) -> None:
        """On the consumer's thread: make the consumer consume exactly what the newest state wants.

        Idempotent and order-free: it reads the state and the consumer's own queues when it runs,
        so any number of these, in any order, leave the consumer on the newest state."""
        with self._lock:
            self._loop_thread = threading.get_ident()
            self._scheduled = False
            target, state, handle, believed = self._requested, self._state, self._handle, self._consuming
        try:
            if handle is None or state.stopping:
                return
            before = handle.consuming()
            if before is None:  # the consumer is restarting: the next heartbeat looks again
                return
            drifted = sorted(before ^ believed)
            wanted = ordered_queues(state)
            for name in self._universe():
                if name in before and name not in wanted:
                    self._apply(handle.cancel, name, state, "worker.consumer_cancelled")
            for name in wanted:
                if name not in before:
                    self._apply(handle.add, name, state, "worker.consumer_added")
            after = handle.consuming()
            if after is None:
                return
            with self._lock:
                self._consuming = after
                self._checked_at = time.monotonic()
            if drifted:
                log.warning("worker.consumer_drift_healed", queues=drifted, consuming=sorted(before),
                            expected=sorted(believed), wanted=wanted)
                for name in drifted:
                    self._heal_observed(name)
            missing = [name for name in wanted if name not in after]
            if missing:
                log.error("worker.consumer_not_applied", missing=missing, consuming=sorted(after))
        finally:
            with self._applied:
                self._done = max(self._done, target)
                self._applied.notify_all()

    def _heal_observed(self, queue: str) -> None:
        if self._on_heal is None:
            return
        try:
            self._on_heal(queue)
        except Exception as exc:  # metrics must never stop the consumer's thread
            log.warning("worker.consumer_heal_metric_failed", error=type(exc).__name__)

    @staticmethod
    def _apply(command: Callable[[str], None], queue: str, state: ConsumerState, event: str) -> None:
        try:
            command(queue)
        except Exception as exc:  # read back below; the next heartbeat tries again
            log.warning("worker.consumer_switch_failed", queue=queue, error=f"{type(exc).__name__}: {exc}")
            return
        log.info(event, queue=queue, state=_describe(state))


def _describe(state: ConsumerState) -> dict[str, Any]:
    """The parts of ``state`` that pause something, for the log line of a change."""
    return {
        "drained": sorted(state.drained), "switching": state.switching, "joint_full": state.joint_full,
        "capacity_full": state.capacity_full, "canary_lane": state.canary_lane,
    }
