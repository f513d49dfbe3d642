"""TESTS ONLY: faults a job asks for in ``params.fault``, honoured only with
``settings.worker.fault_injection``.

The chaos and integration tests need jobs that fail in known ways (a transient error, a bad
input, a stall, a process that dies mid-job). Keeping them here, behind one switch that is off
by default, means the production job path (``worker/job_runner.py``) holds no code that kills
its own process: the runner is handed a ``FaultInjector`` only when the setting is on
(``fault_injector_for``) and otherwise never looks at ``params.fault``.

Faults (``FAULTS``):

- ``transient``: every attempt raises ``TransientJobError`` (retried until exhausted);
- ``transient_once``: the first attempt raises it, the retry succeeds;
- ``input``: ``InputJobError`` (the job fails as invalid input, no retry);
- ``crash``: SIGKILL of the worker process mid-job, every attempt (a poison job);
- ``stall_first_attempt``: the first attempt waits ``fault_stall_seconds`` (or until cancelled)
  before it runs, holding its task thread.

Unknown names (a decision's own faults, ``worker/decide_job.py``) are left to whoever knows them.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

from scheduler.infra.settings import Settings
from scheduler.jobs.retry import InputJobError, TransientJobError
from worker.job_handler import JobSpec

FAULTS: tuple[str, ...] = ("transient", "transient_once", "stall_first_attempt", "input", "crash")


def _kill_this_process() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class FaultInjector:
    """Simulates the fault a job names, just before the job runs (see the module docstring)."""

    def __init__(self, *, stall_seconds: float, kill: Callable[[], None] = _kill_this_process) -> None:
        self.stall_seconds = stall_seconds
        self._kill = kill

    def before_run(self, spec: JobSpec, cancel_event: threading.Event) -> None:
        """Raise, kill or stall as ``spec.params["fault"]`` says; return at once for no fault."""
        fault = spec.params.get("fault")
        if not fault:
            return
        if fault == "transient" or (fault == "transient_once" and spec.attempt == 1):
            raise TransientJobError(f"injected transient fault (attempt {spec.attempt})")
        if fault == "input":
            raise InputJobError("injected input error")
        if fault == "crash":  # a poison job: the process dies mid-job, every attempt (chaos tests)
            self._kill()
        if fault == "stall_first_attempt" and spec.attempt == 1:
            cancel_event.wait(self.stall_seconds)


def fault_injector_for(settings: Settings) -> FaultInjector | None:
    """The injector when ``settings.worker.fault_injection`` is on (tests), else None: no faults at all."""
    if not settings.worker.fault_injection:
        return None
    return FaultInjector(stall_seconds=settings.worker.fault_stall_seconds)
