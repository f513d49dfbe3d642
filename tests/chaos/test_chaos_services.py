"""Service faults: Redis restarted (empty) and flushed mid-run, PostgreSQL restarted mid-run.

Jobs go in through the real API while workers run them; every accepted job must end
``succeeded`` with exactly one outcome write, and the API must never answer 500.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.chaos.conftest import ChaosStack

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

# ~16 denoising passes: jobs are running and queued when the fault hits.
PARAMS: dict[str, Any] = {"max_new_tokens": 16, "steps_per_block": 4, "seed": 11}
BODY: dict[str, Any] = {"kind": "generate", "input": {"prompt": "Chaos"}, "params": PARAMS}


def _submit_many(stack: ChaosStack, client: httpx.Client, count: int) -> list[str]:
    return [stack.submit(client, {**PARAMS, "seed": i}) for i in range(count)]


@pytest.mark.parametrize(("graceful", "snapshot"), [(False, False), (True, True)],
                         ids=["killed-back-empty", "stopped-back-with-snapshot"])
def test_redis_restarted_mid_run_every_accepted_job_completes(
    chaos_stack: ChaosStack, graceful: bool, snapshot: bool
) -> None:
    """Issue 16: a SIGKILLed Redis back empty (every message, marker and lease signal gone) and a
    SIGTERMed one back with its snapshot (stale messages and unacked deliveries of jobs that
    finish meanwhile come back): every accepted job ends exactly once, every process lives."""
    stack = chaos_stack
    stack.ensure_workers(2)
    statuses: list[int] = []
    with stack.client(timeout=15.0) as client:
        accepted = _submit_many(stack, client, 40)
        stack.wait_some_running(accepted)
        stack.redis.stop(graceful=graceful, snapshot=snapshot)
        down_since = time.monotonic()
        while time.monotonic() - down_since < 3.0:  # submissions while Redis is down
            response = client.post("/v1/jobs", json=BODY)
            statuses.append(response.status_code)
            if response.status_code == 202:
                accepted.append(str(response.json()["id"]))
        stack.redis.start()  # same port, empty
        accepted += _submit_many(stack, client, 10)
    assert all(status in (202, 503) for status in statuses), statuses  # accepted, or told to retry
    rows = stack.wait_final(accepted, timeout=90)
    stack.assert_exactly_once(accepted, rows)
    assert stack.beat.proc.poll() is None, "the beat process did not survive the Redis restart"
    assert all(w.proc.poll() is None for w in stack.workers), "a worker did not survive the Redis restart"
    print(f"Redis restart: {len(accepted)} accepted; during the outage {statuses.count(202)} x 202, "
          f"{statuses.count(503)} x 503")


def test_redis_flushed_mid_run_every_accepted_job_completes(chaos_stack: ChaosStack) -> None:
    stack = chaos_stack
    stack.ensure_workers(2)
    with stack.client() as client:
        accepted = _submit_many(stack, client, 40)
        stack.wait_some_running(accepted)
        stack.redis.client().flushall()  # queues, unacked deliveries, markers, registry: all gone
        accepted += _submit_many(stack, client, 10)
    rows = stack.wait_final(accepted, timeout=90)
    stack.assert_exactly_once(accepted, rows)


def test_postgres_restarted_mid_run_503_during_outage_then_recovers(chaos_stack: ChaosStack) -> None:
    stack = chaos_stack
    if stack.postgres is None:
        pytest.skip("no PostgreSQL server binaries (initdb/pg_ctl) for a throwaway cluster "
                    "(apt-get install -y postgresql)")
    stack.ensure_workers(2)
    outage: list[tuple[int, float]] = []  # (status, seconds) of submissions while the DB is down
    with stack.client(timeout=15.0) as client:
        accepted = _submit_many(stack, client, 30)
        stack.wait_some_running(accepted)
        stack.postgres.stop("fast")  # terminates every connection
        down_since = time.monotonic()
        while time.monotonic() - down_since < 4.0:
            began = time.monotonic()
            response = client.post("/v1/jobs", json=BODY)
            outage.append((response.status_code, time.monotonic() - began))
            assert response.status_code != 202, "accepted a job while the database was down"
            if response.status_code == 503:
                assert response.json()["error"]["code"] == "unavailable"
            time.sleep(0.05)
        polled = client.get(f"/v1/jobs/{accepted[0]}")
        assert polled.status_code == 503, polled.text
        stack.postgres.start()

        def submit_after() -> str | None:
            response = client.post("/v1/jobs", json=BODY)
            assert response.status_code in (202, 503), response.text
            return str(response.json()["id"]) if response.status_code == 202 else None

        deadline = time.monotonic() + 30
        recovered: str | None = None
        while recovered is None:
            assert time.monotonic() < deadline, "the API did not recover after PostgreSQL came back"
            recovered = submit_after()
        accepted.append(recovered)
        accepted += _submit_many(stack, client, 10)
    codes = [status for status, _ in outage]
    assert codes and all(status == 503 for status in codes), codes  # fail fast, never 500
    slowest = max(seconds for _, seconds in outage)
    assert slowest < 2.0, f"a submission took {slowest:.2f}s to fail during the outage"
    rows = stack.wait_final(accepted, timeout=90)
    stack.assert_exactly_once(accepted, rows)
    print(f"PostgreSQL restart: {len(codes)} submissions during the outage, all 503, slowest "
          f"{slowest * 1000:.0f} ms; {len(accepted)} accepted jobs all succeeded once")
