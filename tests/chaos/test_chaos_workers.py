"""Worker faults: SIGKILL mid-job (repeatedly), a poison job, SIGTERM with running jobs, and a job
that outlives the Redis visibility timeout. Every job ends with exactly one outcome write."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from tests.chaos.conftest import REPEATED_KILLS, TINY_PARAMS, ChaosStack
from tests.conftest import ServiceProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

# ~32 denoising passes: long enough that a kill lands mid-job, short enough for 2 CPU cores.
MEDIUM_PARAMS: dict[str, Any] = {"max_new_tokens": 32, "steps_per_block": 4, "seed": 7}


def _busy_worker(
    stack: ChaosStack, job_ids: list[str], timeout: float = 30.0
) -> tuple[ServiceProcess, list[str]]:
    """A live worker that holds at least one running job of ``job_ids``, with the ids it holds.

    Both come from ONE read of the table: a second read a moment later can find the worker's
    jobs already finished (a job of the tiny model lasts about a second), and count zero."""

    def find() -> tuple[ServiceProcess, list[str]] | None:
        rows = stack.rows(job_ids)
        for worker in stack.live_workers():
            held = [job_id for job_id, row in rows.items()
                    if row["status"] == "running" and row["worker_id"] == worker.worker_id]
            if held:
                return worker, held
        return None

    return wait_for(find, timeout=timeout, interval=0.05, message="a worker with a running job")


def test_workers_sigkilled_mid_job_repeatedly_every_job_succeeds_exactly_once(
    chaos_stack: ChaosStack,
) -> None:
    stack = chaos_stack
    stack.ensure_workers(2)
    kills = REPEATED_KILLS  # below max_attempts: a job hit by every kill still has an attempt left
    job_ids: list[str] = []
    with stack.client() as client:
        for round_ in range(kills):  # each round: fresh work, then a kill while it runs
            job_ids += [stack.submit(client, {**MEDIUM_PARAMS, "seed": 40 * round_ + i}) for i in range(30)]
            victim, _ = _busy_worker(stack, job_ids)  # it holds a running job: the kill lands mid-job
            victim.kill()  # SIGKILL of the whole process group: no drain, no cleanup
            stack.start_workers(1)  # the supervisor's replacement (the other worker keeps going)
    rows = stack.wait_final(job_ids, timeout=120)
    stack.assert_exactly_once(job_ids, rows)
    retried = sum(1 for row in rows.values() if row["attempt"] > 1)
    assert retried >= kills, f"only {retried} jobs needed a second attempt"


def test_poison_job_that_kills_its_worker_fails_after_max_attempts_and_others_finish(
    chaos_stack: ChaosStack,
) -> None:
    stack = chaos_stack
    stack.ensure_workers(2)
    with stack.client() as client:
        poison = stack.submit(client, {**TINY_PARAMS, "fault": "crash"})
        others = [stack.submit(client, {**TINY_PARAMS, "seed": i}) for i in range(30)]
    deaths = 0
    deadline = time.monotonic() + 120
    while stack.rows([poison])[poison]["status"] not in ("failed", "succeeded", "cancelled"):
        assert time.monotonic() < deadline, f"poison job not final: {stack.rows([poison])}"
        alive = len(stack.live_workers())
        if alive < 2:  # the supervisor restarts what the poison killed
            deaths += 2 - alive
            for _ in range(2 - alive):
                # Not waited for: the poison may kill a replacement before it is ready (Celery
                # consumes before the registry says ready); the next round counts that death.
                stack.spawn_worker()
        time.sleep(0.2)
    # A worker the poison killed just before the job became final was not counted yet: every
    # worker short of two now is one more death.
    deaths += 2 - len(stack.live_workers())
    stack.ensure_workers(2)  # and the others need workers that are ready
    rows = stack.wait_final([poison, *others], timeout=60)
    assert rows[poison]["status"] == "failed"
    assert rows[poison]["error_code"] == "retries_exhausted"
    assert rows[poison]["attempt"] == rows[poison]["max_attempts"] == stack.settings.jobs.max_attempts
    assert deaths >= stack.settings.jobs.max_attempts  # each attempt really killed a worker
    stack.assert_exactly_once([poison], rows, status="failed")
    stack.assert_exactly_once(others, rows)


def test_sigterm_with_running_jobs_they_finish_or_are_handed_back_none_lost(chaos_stack: ChaosStack) -> None:
    stack = chaos_stack
    stack.ensure_workers(2)
    with stack.client() as client:
        job_ids = [stack.submit(client, {**MEDIUM_PARAMS, "seed": 100 + i}) for i in range(24)]
    victim, held = _busy_worker(stack, job_ids)
    asked = time.monotonic()
    victim.send_sigterm()
    assert victim.proc.wait(timeout=60) == 0  # a clean, drained exit
    drain_seconds = time.monotonic() - asked
    stack.start_workers(1)
    rows = stack.wait_final(job_ids, timeout=90)
    stack.assert_exactly_once(job_ids, rows)
    # ``assert_exactly_once`` covers what the victim held (a snapshot from just before the
    # SIGTERM): each job finished there (the drain) or was handed back and finished elsewhere.
    drained = sum(rows[job_id]["worker_id"] == victim.worker_id for job_id in held)
    print(f"SIGTERM: worker held {len(held)} running jobs ({drained} finished there, "
          f"{len(held) - drained} handed back), exited 0 after {drain_seconds:.1f}s")


def test_job_longer_than_the_visibility_timeout_is_redelivered_but_runs_once(chaos_stack: ChaosStack) -> None:
    from scheduler.infra.celery_app import create_celery_app

    stack = chaos_stack
    stack.ensure_workers(2)
    visibility = 2.0
    tiny_visibility = stack.settings.replaced(visibility_timeout_seconds=visibility)
    # The test-only stall holds the attempt (running, lease renewed by the monitor) until the
    # job is cancelled: a long job whose length does not depend on when the model emits EOS.
    long_params = {**TINY_PARAMS, "fault": "stall_first_attempt"}
    with stack.client() as client:
        job_id = stack.submit(client, long_params)
    _busy_worker(stack, [job_id])
    started = time.monotonic()
    time.sleep(visibility + 1.0)
    assert stack.rows([job_id])[job_id]["status"] == "running"
    # Kombu's visibility sweep, as any consumer with this timeout runs it (at start-up and then
    # periodically): the running job's message is unacked for longer than the timeout, so it
    # goes back to its queue and a worker receives it again while the first attempt still runs.
    with create_celery_app(tiny_visibility).connection_for_read() as connection:
        connection.default_channel.qos.restore_visible(num=1000, interval=1)
    wait_for(lambda: job_id in _not_claimed(stack), timeout=30,
             message="the redelivered message to be consumed and refused by the fence")
    time.sleep(stack.settings.jobs.lease_seconds)  # outlive a lease too: it must be renewed, not reaped
    assert stack.rows([job_id])[job_id]["status"] == "running"
    ran_for = time.monotonic() - started
    with stack.client() as client:
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    rows = stack.wait_final([job_id], timeout=30)
    stack.assert_exactly_once([job_id], rows, status="cancelled")
    assert rows[job_id]["attempt"] == 1  # the lease was renewed; nobody re-ran it
    assert ran_for > visibility + stack.settings.jobs.lease_seconds
    print(f"visibility timeout {visibility:.0f}s: job ran {ran_for:.1f}s, redelivered once, executed once")


def _not_claimed(stack: ChaosStack) -> str:
    return "\n".join(line for line in stack.worker_logs().splitlines() if "job.not_claimed" in line)


def test_worker_killed_between_delivery_and_claim_leaves_no_job_stuck(chaos_stack: ChaosStack) -> None:
    """Found by the kill test: the message sat in the dead worker's unacked set (visibility
    timeout: hours) with the enqueued marker still set, so nothing republished the job."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    stack = chaos_stack
    stack.ensure_workers(1)
    env = {**os.environ, **stack.settings.to_env()}
    done = subprocess.run([sys.executable, "-m", "tests.chaos.dying_consumer", "chaos-orphan"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    job_id = done.stdout.split("job ", 1)[1].split()[0]
    assert done.returncode == -9, done.stdout + done.stderr  # it died holding the delivery
    held = stack.whereabouts(job_id, stack.rows([job_id]).get(job_id))
    assert held["status"] == "queued" and held["marker"] and held["unacked"], held
    rows = stack.wait_final([job_id], timeout=30)
    stack.assert_exactly_once([job_id], rows)
    assert rows[job_id]["attempt"] == 1
