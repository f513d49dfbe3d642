"""Which Celery queues this worker consumes: one pure rule, one controller that applies it.

Several things decide whether a worker should take messages from a queue, and they used to
switch Celery consumers on and off separately, kept apart by precedence checks ("resume joint
unless an operator drained it", "re-add after a switch minus the drained queues", ...):

- the configured queues (``celery worker --queues``);
- the operator's drain flags (``scheduler.drain``; followed by ``worker/queue_drain.py``);
- a model switch (``worker/model_switcher.py``): while it drains and loads, nothing;
- the joint gate: at ``engine_joint_slot_cap`` joint jobs, no ``joint`` (``worker/joint_gate.py``);
- the capacity gate: at ``engine_max_batch`` non-interactive jobs, no ``standard``/``bulk`` (the
  threads beyond are the interactive reserve; ``joint`` is the joint gate's alone);
- the canary lane: a worker serving the canary version consumes ``canary.<queue>`` instead of
  ``<queue>`` (``scheduler/canary_routing.py``);
- shutdown: after SIGTERM Celery stops the consumer itself; nothing is added again.

``consumed_queues`` turns that state into the set of Celery queue names, with no I/O, so every
combination is a table row in ``tests/unit/test_worker_consumers.py``. ``ConsumerController``
holds the state, recomputes the set on every change and sends only the difference as Celery
remote-control commands addressed to this worker's own node (handled on its consumer thread, so
nothing here touches kombu state from another thread).

Consumers are delivery, never the guarantee: a message that slips in before a cancel takes
effect is handed back unclaimed by the job runner (gates, ``JobAdmission``, draining), and the
claim's version check keeps a job off the wrong model version whatever queue carried it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypedDict, Unpack

import structlog

from scheduler.canary_routing import lane_names
from worker.joint_gate import JOINT_QUEUE, PAUSABLE_AT_CAPACITY

log = structlog.get_logger(__name__)

REPLY_TIMEOUT_SECONDS = 2.0  # how long a waited-for command waits for the consumer's answer


@dataclass(frozen=True)
class ConsumerState:
    """Everything that decides what this worker consumes (class queue names, not lanes)."""

    configured: tuple[str, ...]  # priority order, as `celery worker --queues` got them
    drained: frozenset[str] = field(default_factory=frozenset)  # operator-drained (scheduler.drain)
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


class ConsumerCommands(Protocol):
    """Starts and stops this worker's consumer of one Celery queue. ``wait``: until it answered."""

    def add(self, queue: str, *, wait: bool) -> None: ...

    def cancel(self, queue: str, *, wait: bool) -> None: ...


class CeleryConsumers:
    """``ConsumerCommands`` through Celery remote control addressed to this worker's own node."""

    def __init__(self, app: Callable[[], Any], *, node: str) -> None:
        """``app``: returns the Celery app (looked up when a command is sent, not before)."""
        self._app = app
        self._node = node

    def add(self, queue: str, *, wait: bool) -> None:
        self._app().control.add_consumer(queue, destination=[self._node], **self._reply(wait))

    def cancel(self, queue: str, *, wait: bool) -> None:
        self._app().control.cancel_consumer(queue, destination=[self._node], **self._reply(wait))

    @staticmethod
    def _reply(wait: bool) -> dict[str, Any]:
        return {"reply": True, "timeout": REPLY_TIMEOUT_SECONDS} if wait else {}


class AmqpQueues(Protocol):
    """The part of a Celery app's ``amqp.queues`` used before the consumer starts."""

    @property
    def consume_from(self) -> Any: ...

    def deselect(self, exclude: list[str]) -> None: ...

    def select_add(self, queue: str) -> Any: ...


class ConsumerController:
    """Holds the ``ConsumerState`` and keeps Celery consuming ``consumed_queues`` of it.

    Two locks, and no I/O under the state lock. ``record`` changes the state (the state lock,
    held for an assignment: a gate calls it under its own lock, so changes are recorded in the
    order they happened). ``sync`` sends the difference between what is consumed and what the
    NEWEST state wants, outside the state lock, one sender at a time (the send lock): a caller
    that must not wait (a gate on a task thread, the heartbeat on the monitor thread, a SIGTERM
    handler) leaves the sending to the thread already doing it, which looks at the state again
    after it released the send lock, so no change is left unsent. A command that blocks (a broker
    that went away: kombu retries) therefore holds up only the thread sending it, never the
    gates, the heartbeat or the lease renewal. A command that fails is logged and left out of
    what is believed consumed, so the next change tries it again.

    Before ``go_live`` (Celery's consumer does not exist yet) changes are only recorded: the
    start-up selection is made on the app's ``amqp.queues`` (``select_at_start``), and
    ``go_live`` sends whatever changed since. Once ``stopping``, nothing is sent any more (the
    warm shutdown stops the consumer itself).
    """

    def __init__(self, configured: Sequence[str], commands: ConsumerCommands) -> None:
        self._commands = commands
        self._state = ConsumerState(configured=tuple(configured))
        # what `celery worker --queues` starts consuming; corrected by select_at_start
        self._applied: frozenset[str] = frozenset(self._state.configured)
        self._live = False
        self._dirty = False  # the state changed since the last send looked at it
        self._flipped: frozenset[str] = frozenset()  # drain flags changed since then
        # Re-entrant: Celery runs its SIGTERM handler (``mark_draining`` -> ``record``) on the
        # main thread, which may be inside ``go_live`` or ``select_at_start`` at that moment.
        self._lock = threading.RLock()
        self._send_lock = threading.Lock()

    @property
    def state(self) -> ConsumerState:
        return self._state

    @property
    def consuming(self) -> frozenset[str]:
        """The Celery queues this worker consumes as far as the controller knows."""
        return self._applied

    def record(self, **changes: Unpack[StateChange]) -> None:
        """Change the named parts of the state (None: unchanged); sends nothing (see ``sync``)."""
        values: dict[str, Any] = {name: value for name, value in changes.items() if value is not None}
        if "drained" in values:
            values["drained"] = frozenset(values["drained"])
        with self._lock:
            previous = self._state
            self._state = replace(previous, **values)
            self._flipped |= previous.drained ^ self._state.drained
            self._dirty = True

    def update(self, *, wait: bool = False, **changes: Unpack[StateChange]) -> None:
        """``record`` the changes, then ``sync``.

        ``wait``: wait for the send lock and for each command's answer (a model switch wants its
        consumers gone before it drains); otherwise a sender already at work sends this change."""
        self.record(**changes)
        self.sync(wait=wait)

    def sync(self, *, wait: bool = False) -> None:
        """Send what the newest state needs (see the class docstring for who sends)."""
        while True:
            if not self._send_lock.acquire(blocking=wait):
                return  # the thread holding it looks at the state again once it is done
            try:
                self._send_newest(wait=wait)
            finally:
                self._send_lock.release()
            with self._lock:
                if not (self._dirty and self._live and not self._state.stopping):
                    return
            wait = False  # changed meanwhile: send it, unless another thread already is

    def go_live(self) -> None:
        """Celery's consumer runs (``worker_ready``): from now on changes are sent to it."""
        with self._lock:
            self._live = True
            self._dirty = True
            self._flipped = frozenset()  # no consumer existed for a broadcast to change
        self.sync()

    def select_at_start(self, queues: AmqpQueues) -> list[str]:
        """On ``worker_init``, before any consumer exists: select exactly the queues the state
        consumes on the app's ``amqp.queues`` (drained queues never consumed at all, a canary
        worker on its lanes from its first message on). Returns them in priority order."""
        with self._lock:
            wanted = ordered_queues(self._state)
            everything = [*self._state.configured, *lane_names(self._state.configured, canary=True)]
            current = set(queues.consume_from)
            stale = [name for name in everything if name in current and name not in wanted]
            if stale:
                queues.deselect(stale)
            for name in wanted:
                if name not in current:
                    queues.select_add(name)
            self._applied = frozenset(wanted)
            self._flipped = frozenset()
        if stale or set(wanted) - current:
            log.info("worker.queues_selected_at_start", queues=wanted, deselected=stale)
        return wanted

    def _send_newest(self, *, wait: bool) -> None:
        """Send the difference between what is consumed and what the state wants (send lock held).

        The drain flags that flipped since the last send: the operator's broadcast
        (``scheduler.drain``) changed those consumers behind this controller's back, by their
        plain names, so both of their lanes are set to what the state wants whatever the
        controller believed (both commands are idempotent in Celery)."""
        with self._lock:
            if not self._live or self._state.stopping:
                return
            state, flipped, applied = self._state, self._flipped, set(self._applied)
            self._dirty, self._flipped = False, frozenset()
        wanted = consumed_queues(state)
        touched = {name for queue in state.configured if queue in flipped
                   for name in (queue, *lane_names([queue], canary=True))}
        order = [*state.configured, *lane_names(state.configured, canary=True)]
        to_cancel = [name for name in order if name not in wanted and (name in applied or name in touched)]
        to_add = [name for name in ordered_queues(state) if name not in applied or name in touched]
        for name in to_cancel:
            if self._send(self._commands.cancel, name, state, wait=wait, event="worker.consumer_cancelled"):
                applied.discard(name)
        for name in to_add:
            if self._send(self._commands.add, name, state, wait=wait, event="worker.consumer_added"):
                applied.add(name)
        with self._lock:
            self._applied = frozenset(applied)

    @staticmethod
    def _send(command: Any, queue: str, state: ConsumerState, *, wait: bool, event: str) -> bool:
        try:
            command(queue, wait=wait)
        except Exception as exc:  # consumers are an optimisation: the runner's hand-back holds
            log.warning("worker.consumer_switch_failed", queue=queue, error=f"{type(exc).__name__}: {exc}")
            return False
        log.info(event, queue=queue, state=_describe(state))
        return True


def _describe(state: ConsumerState) -> dict[str, Any]:
    """The parts of ``state`` that pause something, for the log line of a change."""
    return {
        "drained": sorted(state.drained), "switching": state.switching, "joint_full": state.joint_full,
        "capacity_full": state.capacity_full, "canary_lane": state.canary_lane,
    }
