"""Short requests first under bulk load: a worker keeps task threads and engine slots that only
interactive jobs may take (``engine_interactive_reserve``), so a bulk batch that fills the
worker never makes an interactive job wait for it (issue 15, the newcomer's scenario)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from scheduler.infra.settings import Settings
from tests.conftest import ProcessLauncher, clear_leftover_jobs, wait_for

pytestmark = pytest.mark.integration

BATCH = 40
MAX_BATCH = 4
BULK_PARAMS = {"max_new_tokens": 1024, "block_size": 4, "steps_per_block": 4}  # long: the batch is cancelled


@pytest.fixture(scope="module")
def stack(
    make_settings: Callable[..., Settings], demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Settings, TestClient]]:
    settings = make_settings(model_dir=demo_checkpoint, auth="disabled", engine_max_batch=MAX_BATCH,
                             engine_interactive_reserve=1, tenant_max_active_jobs=10 * BATCH,
                             log_level="WARNING")  # fmt: skip
    clear_leftover_jobs(settings)  # the worker must see this module's jobs only
    launcher = ProcessLauncher(tmp_path_factory.mktemp("capacity-logs"))
    try:  # one worker consuming every queue, threads left at their default (batch + reserve), as `cloverq up`
        launcher.start_worker(settings, queues="interactive,standard,bulk,joint")
        launcher.start_beat(settings)
        with TestClient(create_app(settings)) as client:
            yield settings, client
    finally:
        launcher.close()


def _job(client: TestClient, job_id: str) -> dict:
    response = client.get(f"/v1/jobs/{job_id}")
    assert response.status_code == 200, response.text
    return response.json()


def test_an_interactive_job_starts_before_a_bulk_batch_ends(stack: tuple[Settings, TestClient]) -> None:
    """40 long bulk jobs fill the worker; an interactive job submitted then takes a reserved task
    thread and engine slot at once: no bulk job takes its place, and it does not wait for one to end."""
    _, client = stack
    specs = [{"kind": "generate", "input": {"prompt": f"Clause {i}"}, "params": {**BULK_PARAMS, "seed": i}}
             for i in range(BATCH)]  # fmt: skip
    batch = client.post("/v1/batches", json={"jobs": specs})
    assert batch.status_code == 202, batch.text
    batch_id = batch.json()["id"]
    try:
        running = lambda: client.get(f"/v1/batches/{batch_id}").json()["counts"].get("running", 0)  # noqa: E731
        wait_for(lambda: running() >= MAX_BATCH,
                 timeout=60, message="the batch fills the worker")  # fmt: skip
        time.sleep(1.0)  # every bulk thread busy, the rest of the batch waiting in its queue
        body = {"kind": "generate", "input": {"prompt": "Hi"},
                "params": {"max_new_tokens": 4, "block_size": 4, "steps_per_block": 1}}  # fmt: skip
        short = client.post("/v1/jobs", json=body)
        assert short.status_code == 202, short.text
        short_id = short.json()["id"]
        done = wait_for(lambda: (j := _job(client, short_id))["status"] == "succeeded" and j, timeout=60,
                        message="the interactive job finishes")  # fmt: skip
    finally:
        client.post(f"/v1/batches/{batch_id}/cancel")
    assert done["queue"] == "interactive"
    timings = done["timings"]
    waited = _seconds(timings["started_at"]) - _seconds(timings["created_at"])
    assert waited < 2.0, f"the interactive job waited {waited:.1f}s for a task thread behind bulk work"
    assert timings["engine_queue_ms"] is not None and timings["engine_queue_ms"] < 2000.0  # a reserved slot
    wait_for(lambda: client.get(f"/v1/batches/{batch_id}").json()["status"] in ("cancelled", "completed"),
             timeout=120, message="the batch ends")  # fmt: skip
    lines = client.get(f"/v1/batches/{batch_id}/results").text.strip().splitlines()
    bulk = [_job(client, json.loads(line)["job_id"]) for line in lines]
    spans = [(_seconds(j["timings"]["started_at"]),
              _seconds(j["timings"]["finished_at"]) if j["timings"].get("finished_at") else float("inf"))
             for j in bulk if j["timings"]["started_at"]]  # fmt: skip

    def bulk_running_at(moment: float) -> int:
        return sum(start < moment < end for start, end in spans)

    # Bulk work never holds more than its engine_max_batch threads, so it never takes a reserved one:
    # at every bulk start, fewer than MAX_BATCH other bulk jobs were running.
    assert all(bulk_running_at(start) < MAX_BATCH for start, _ in spans), spans
    # A bulk job that starts while the interactive job waits may only take a bulk slot that another
    # bulk job freed (the random demo model ends some jobs at once with an end-of-text token).
    overtook = [start for start, _ in spans
                if _seconds(timings["created_at"]) < start < _seconds(timings["started_at"])
                and bulk_running_at(start) >= MAX_BATCH]  # fmt: skip
    assert not overtook, "bulk jobs took the interactive job's place between its submit and its start"
    assert len(spans) < BATCH  # the batch was still waiting when the interactive job was done


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
