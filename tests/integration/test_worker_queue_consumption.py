"""A worker keeps consuming every queue it is configured for, however fast its gates churn (issue 31).

Under load the capacity gate fills and frees within milliseconds, and the worker stops consuming
``standard`` and ``bulk`` and starts again. Those switches used to be Celery remote-control
broadcasts to the worker's own node (cancel, cancel, add, add); Celery schedules each with
``consumer.call_soon``, and kombu's event loop keeps pending callbacks in a ``set``, so commands
that arrive in one loop iteration (the loop is slow while the engine thread computes) run in no
particular order: an add that ran before its cancel was a no-op, and the cancel then left the
queue unconsumed for good (nothing fills the gate again). The worker now switches its consumer in
process and reads it back (``worker/consumers.py``).

Two real workers on all four queues, each with long bulk jobs keeping its engine busy, churn their
capacity gates with the messages of a cancelled batch (each skipped in milliseconds) and a burst
of short bulk jobs. After every round each worker's Celery consumer, asked directly
(``inspect().active_queues()``), must be on all four queues, and every short job must have run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.settings import Settings
from tests.conftest import ProcessLauncher, ServiceProcess, clear_leftover_jobs, wait_for

pytestmark = pytest.mark.integration

ALL_QUEUES = {"interactive", "standard", "bulk", "joint"}
ROUNDS = 3
MAX_BATCH = 4  # the capacity gate's cap: two long jobs hold half of it, the churn the other half
LONG = 2  # long bulk jobs per worker and round: the engine computes while the gate churns
DEAD = 300  # jobs of a batch cancelled at once: their messages pass the gate in milliseconds each
BURST = 30  # short live bulk jobs per round
SHORT_BULK = {"max_new_tokens": 4, "block_size": 4, "steps_per_block": 1}  # batch jobs go to bulk
LONG_BULK = {"max_new_tokens": 2048, "temperature": 1.0, "top_p": 0.95}


@pytest.fixture(scope="module")
def fleet(
    make_settings: Callable[..., Settings], demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Settings, TestClient, list[ServiceProcess]]]:
    settings = make_settings(model_dir=demo_checkpoint, auth="disabled", engine_max_batch=MAX_BATCH,
                             engine_interactive_reserve=1, tenant_max_active_jobs=10 * (DEAD + BURST),
                             log_level="INFO")  # fmt: skip
    clear_leftover_jobs(settings)
    launcher = ProcessLauncher(tmp_path_factory.mktemp("consumption-logs"))
    try:
        queues = "interactive,standard,bulk,joint"
        workers = [launcher.start_worker(settings, queues=queues) for _ in range(2)]
        launcher.start_beat(settings)
        with TestClient(create_app(settings)) as client:
            yield settings, client, workers
    finally:
        launcher.close()


def consumed_by(settings: Settings, nodes: list[str]) -> dict[str, set[str]]:
    """What each node's Celery consumer consumes, asked of the consumer itself."""
    answer = create_celery_app(settings).control.inspect(destination=nodes, timeout=3.0).active_queues() or {}
    return {node: {queue["name"] for queue in answer.get(node, [])} for node in nodes}


def batch_of(client: TestClient, params: dict, n: int, tag: str) -> str:
    specs = [{"kind": "generate", "input": {"prompt": f"{tag} {i}"}, "params": {**params, "seed": i}}
             for i in range(n)]  # fmt: skip
    response = client.post("/v1/batches", json={"jobs": specs})
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def test_gate_churn_never_leaves_a_worker_off_its_queues(
    fleet: tuple[Settings, TestClient, list[ServiceProcess]],
) -> None:
    settings, client, workers = fleet
    nodes = [str(w.worker_id) for w in workers]
    assert len(nodes) == 2 and all(nodes)
    everything = {node: ALL_QUEUES for node in nodes}
    assert consumed_by(settings, nodes) == everything
    for round_no in range(ROUNDS):
        long_batch = batch_of(client, LONG_BULK, LONG * len(nodes), f"Long {round_no}")
        # every long job claimed (the random demo may end one early with end-of-text)
        wait_for(lambda b=long_batch: client.get(f"/v1/batches/{b}").json()["counts"].get("queued", 0) == 0,
                 timeout=60, message="the long jobs start")  # fmt: skip
        dead = batch_of(client, SHORT_BULK, DEAD, f"Dead {round_no}")
        assert client.post(f"/v1/batches/{dead}/cancel").status_code == 200
        short = batch_of(client, SHORT_BULK, BURST, f"Short {round_no}")
        deadline = time.monotonic() + 120
        while client.get(f"/v1/batches/{short}").json()["status"] != "completed":
            if time.monotonic() > deadline:
                counts = client.get(f"/v1/batches/{short}").json()["counts"]
                pytest.fail(f"round {round_no}: {counts}; consumers {consumed_by(settings, nodes)}")
            time.sleep(0.2)
        assert client.post(f"/v1/batches/{long_batch}/cancel").status_code == 200
        # Once the gate is free again each consumer is on every queue (put right within a heartbeat).
        wait_for(lambda: consumed_by(settings, nodes) == everything, timeout=10, interval=0.3,
                 message=f"round {round_no}: both workers consume all four queues")  # fmt: skip
