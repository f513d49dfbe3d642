"""Test-only faults (``worker/fault_injection.py``): off by default, out of the job runner."""

from __future__ import annotations

import inspect
import threading
import time

import pytest

import worker.job_runner
from scheduler.infra.settings import Settings
from scheduler.jobs.retry import InputJobError, TransientJobError
from worker.fault_injection import FAULTS, FaultInjector, fault_injector_for
from worker.job_handler import JobSpec


def spec(fault: str | None, attempt: int = 1) -> JobSpec:
    params = {"fault": fault} if fault else {}
    return JobSpec(job_id="j", kind="generate", queue="interactive", attempt=attempt, input={}, params=params)


def test_off_by_default_and_on_with_the_setting() -> None:
    assert fault_injector_for(Settings()) is None
    injector = fault_injector_for(Settings(fault_injection=True, fault_stall_seconds=7.0))
    assert injector is not None and injector.stall_seconds == 7.0


@pytest.mark.parametrize(("fault", "attempt", "raises"), [
    ("transient", 1, TransientJobError), ("transient", 3, TransientJobError),
    ("transient_once", 1, TransientJobError), ("transient_once", 2, None),
    ("input", 1, InputJobError), ("input", 2, InputJobError),
    ("stall_first_attempt", 2, None), (None, 1, None), ("invalid_rationale_once", 1, None),
])
def test_faults_raise_as_named(fault: str | None, attempt: int, raises: type[Exception] | None) -> None:
    injector = FaultInjector(stall_seconds=60.0, kill=lambda: pytest.fail("no kill"))
    if raises is None:
        injector.before_run(spec(fault, attempt), threading.Event())
    else:
        with pytest.raises(raises):
            injector.before_run(spec(fault, attempt), threading.Event())


def test_crash_kills_on_every_attempt() -> None:
    kills: list[int] = []
    injector = FaultInjector(stall_seconds=0.0, kill=lambda: kills.append(1))
    injector.before_run(spec("crash", 1), threading.Event())
    injector.before_run(spec("crash", 2), threading.Event())
    assert kills == [1, 1]


def test_stall_waits_until_cancelled() -> None:
    injector = FaultInjector(stall_seconds=30.0)
    cancel = threading.Event()
    threading.Timer(0.05, cancel.set).start()
    began = time.monotonic()
    injector.before_run(spec("stall_first_attempt", 1), cancel)
    assert time.monotonic() - began < 5


def test_the_job_runner_holds_no_kill_path() -> None:
    source = inspect.getsource(worker.job_runner)
    assert "SIGKILL" not in source and "os.kill" not in source
    assert set(FAULTS) == {"transient", "transient_once", "stall_first_attempt", "input", "crash"}
