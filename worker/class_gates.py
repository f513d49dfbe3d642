"""At most ``cap`` jobs of some classes hold task threads of one worker: the joint and capacity gates.

The engine already caps the slots joint requests may hold, but a Celery thread waiting for an
engine slot is a thread no short job can use: a worker consuming ``joint`` next to the short
queues could fill every thread with joint work. The joint gate keeps short work unaffected:

- a joint message is only run when the gate admits it (``try_enter``);
- when the gate is full the worker stops consuming ``joint`` and resumes when a joint job
  leaves: the gate reports each change of fullness (``on_full``) to the consumer controller
  (``worker/consumers.py``), which alone decides what is consumed (an operator's drain, a model
  switch and the canary lane are its inputs too, so the gate needs to know none of them);
- a joint message that slipped in before the pause took effect is handed back unclaimed (its
  enqueued marker dropped: the reconciler republishes it), exactly like a message delivered
  while the worker drains.

The same gate, over every class but ``interactive`` with a cap of ``engine_max_batch``, keeps the
``engine_interactive_reserve`` threads beyond that free for interactive jobs (the capacity gate:
when full the controller pauses ``standard`` and ``bulk``; a joint job past the cap is handed
back, and only the joint gate pauses the joint consumer).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from scheduler.infra.queue_names import QueueName

log = structlog.get_logger(__name__)

JOINT_QUEUE = QueueName.JOINT.value
INTERACTIVE_QUEUE = QueueName.INTERACTIVE.value
# The classes the capacity gate pauses (the joint consumer is the joint gate's).
PAUSABLE_AT_CAPACITY = (QueueName.STANDARD.value, QueueName.BULK.value)


class ClassGate:
    """A gate over some job classes (the joint gate: ``joint``; the capacity gate: every class but
    ``interactive``): counts the jobs of its classes this worker runs; says when it fills up and
    frees again."""

    def __init__(self, cap: int, *, on_full: Callable[[bool], None], then: Callable[[], None] | None = None,
                 name: str = JOINT_QUEUE) -> None:
        """``on_full(full)`` is called on every change of fullness, under the gate's lock, so the
        calls arrive in the order the changes happened (a fill racing a leave cannot leave the
        consumer paused with the gate free): it must only record (no I/O: every task thread
        entering or leaving waits for this lock). ``then()`` runs after the lock is released,
        following a change: where the recorded change is acted on (consumer commands)."""
        self.cap = cap
        self.name = name
        self._on_full = on_full
        self._then = then
        self._lock = threading.Lock()
        self._active = 0
        self._full = False

    @property
    def active(self) -> int:
        return self._active

    @property
    def full(self) -> bool:
        return self._full

    def try_enter(self) -> bool:
        """Admit one job, or refuse it (the caller hands the message back)."""
        with self._lock:
            if self._active >= self.cap:
                return False
            self._active += 1
            changed = self._active >= self.cap and not self._full
            if changed:
                self._full = True
                self._report(True, "worker.gate_full")
        if changed:
            self._act()
        return True

    def leave(self) -> None:
        """A job finished (any outcome): free its place; say so if the gate was full."""
        with self._lock:
            self._active = max(0, self._active - 1)
            changed = self._full and self._active < self.cap
            if changed:
                self._full = False
                self._report(False, "worker.gate_free")
        if changed:
            self._act()

    def _act(self) -> None:
        if self._then is None:
            return
        try:
            self._then()
        except Exception as exc:  # consumption control is an optimisation; the gate still holds
            log.warning("worker.gate_action_failed", gate=self.name, error=f"{type(exc).__name__}: {exc}")

    def _report(self, full: bool, event: str) -> None:
        try:
            self._on_full(full)
        except Exception as exc:  # consumption control is an optimisation; the gate still holds
            log.warning("worker.gate_report_failed", gate=self.name, error=f"{type(exc).__name__}: {exc}")
            return
        log.info(event, gate=self.name, active=self._active, cap=self.cap)


def interactive_reserve(queues: tuple[str, ...] | list[str], reserve: int) -> int:
    """Threads and engine slots held back for interactive jobs: only where both kinds are consumed."""
    others = [q for q in queues if q != INTERACTIVE_QUEUE]
    return reserve if INTERACTIVE_QUEUE in queues and others else 0
