"""At most ``engine_joint_slot_cap`` joint decisions hold task threads of one worker.

The engine already caps the slots joint requests may hold, but a Celery thread waiting for an
engine slot is a thread no short job can use: a worker consuming ``joint`` next to the short
queues could fill every thread with joint work. The gate keeps short work unaffected:

- a joint message is only run when the gate admits it (``try_enter``);
- when the gate is full the worker stops consuming ``joint`` (a Celery remote-control
  ``cancel_consumer`` addressed to itself) and resumes when a joint job leaves — unless an
  operator drained the queue meanwhile;
- a joint message that slipped in before the pause took effect is handed back unclaimed (its
  enqueued marker dropped: the reconciler republishes it), exactly like a message delivered
  while the worker drains.

The same gate, over every class but ``interactive`` with a cap of ``engine_max_batch``, keeps the
``engine_interactive_reserve`` threads beyond that free for interactive jobs (``capacity_gate_for``:
it pauses ``standard`` and ``bulk``; a joint job past the cap is handed back, and the joint gate
alone switches the joint consumer).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)

JOINT_QUEUE = "joint"
INTERACTIVE_QUEUE = "interactive"
PAUSABLE_AT_CAPACITY = ("standard", "bulk")  # the joint consumer is the joint gate's


class JointGate:
    """Counts the joint jobs this worker runs and switches the joint consumer at the cap."""

    def __init__(self, cap: int, *, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self.cap = cap
        self._pause = pause
        self._resume = resume
        self._lock = threading.Lock()
        self._active = 0
        self._paused = False

    @property
    def active(self) -> int:
        return self._active

    def try_enter(self) -> bool:
        """Admit one joint job, or refuse it (the caller hands the message back)."""
        with self._lock:
            if self._active >= self.cap:
                return False
            self._active += 1
            pause = self._active >= self.cap and not self._paused
            if pause:
                self._paused = True
        if pause:
            self._switch(self._pause, "worker.joint_consumer_paused")
        return True

    def leave(self) -> None:
        """A joint job finished (any outcome): free its place, resume consuming if paused."""
        with self._lock:
            self._active = max(0, self._active - 1)
            resume = self._paused and self._active < self.cap
            if resume:
                self._paused = False
        if resume:
            self._switch(self._resume, "worker.joint_consumer_resumed")

    def _switch(self, action: Callable[[], None], event: str) -> None:
        try:
            action()
        except Exception as exc:  # consumption control is an optimisation; the gate still holds
            log.warning("worker.joint_consumer_switch_failed", error=f"{type(exc).__name__}: {exc}")
            return
        log.info(event, active=self._active, cap=self.cap)


def consumer_switches(
    app: object, *, node: str, is_drained: Callable[[str], bool], queues: tuple[str, ...] = (JOINT_QUEUE,),
    lane: Callable[[str], str] | None = None,
) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(pause, resume)`` for this worker's consumers of ``queues`` via Celery remote control.
    ``lane``: the Celery queue consumed for a class queue now (a canary worker's ``canary.<queue>``)."""
    named = lane or (lambda queue: queue)

    def pause() -> None:
        for queue in queues:
            app.control.cancel_consumer(named(queue), destination=[node])  # type: ignore[attr-defined]

    def resume() -> None:
        for queue in queues:
            if not is_drained(queue):  # an operator's drain wins over the gate
                app.control.add_consumer(named(queue), destination=[node])  # type: ignore[attr-defined]

    return pause, resume


def _gate_for(*, cap: int, node: str, redis_client: object, queues: tuple[str, ...],
              lane: Callable[[str], str] | None = None) -> JointGate:
    from scheduler.celery_app import get_celery_app
    from scheduler.drain import drained_queues

    def is_drained(queue: str) -> bool:
        return queue in drained_queues(redis_client)  # type: ignore[arg-type]

    pause, resume = consumer_switches(get_celery_app(), node=node, is_drained=is_drained, queues=queues,
                                      lane=lane)
    return JointGate(cap, pause=pause, resume=resume)


def joint_gate_for(*, cap: int, node: str, redis_client: object,
                   lane: Callable[[str], str] | None = None) -> JointGate:
    """The gate of a worker consuming ``joint``, switching its consumer through the Celery app."""
    return _gate_for(cap=cap, node=node, redis_client=redis_client, queues=(JOINT_QUEUE,), lane=lane)


def capacity_gate_for(*, cap: int, node: str, redis_client: object, queues: tuple[str, ...],
                      lane: Callable[[str], str] | None = None) -> JointGate:
    """The gate that keeps every class but interactive within ``cap`` task threads."""
    pausable = tuple(q for q in PAUSABLE_AT_CAPACITY if q in queues)
    return _gate_for(cap=cap, node=node, redis_client=redis_client, queues=pausable, lane=lane)


def interactive_reserve(queues: tuple[str, ...] | list[str], reserve: int) -> int:
    """Threads and engine slots held back for interactive jobs: only where both kinds are consumed."""
    others = [q for q in queues if q != INTERACTIVE_QUEUE]
    return reserve if INTERACTIVE_QUEUE in queues and others else 0
