"""``/metrics`` after real jobs: a real Celery worker on the tiny demo model, real Redis and SQL.

Checks every family of ``scheduler.observability.metric_families.FAMILIES`` is exported, with the
values the jobs
must have produced; that the request id sent to the API reaches the worker's job summary log
line; and the Redis-backed recorder/collector on its own (histogram buckets, snapshot expiry).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from scheduler.infra.settings import Settings
from scheduler.observability.cluster_metrics import render_metrics
from scheduler.observability.metric_families import FAMILIES
from scheduler.observability.metrics_recorder import RedisMetricsRecorder, WorkerSnapshot

pytestmark = pytest.mark.integration

FINAL = {"succeeded", "failed", "cancelled", "expired"}
JOB_BODY = {"kind": "generate", "input": {"prompt": "Observe me"}, "params": {"max_new_tokens": 8}}


def _families(text: str) -> dict[str, Any]:
    """Parsed exposition keyed by the name in FAMILIES (counters parse without ``_total``)."""
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    out: dict[str, Any] = {}
    for name, spec in FAMILIES.items():
        key = name.removesuffix("_total") if spec.type == "counter" else name
        if key in parsed:
            out[name] = parsed[key]
    return out


def _samples(family: Any, suffix: str = "") -> list[Any]:
    return [s for s in family.samples if s.name == family.name + suffix]


def _finished_by_kind_and_status(family: Any) -> dict[tuple[str, str], float]:
    """Finished jobs summed over the queue label (the same kind and status can finish in several
    queues: class capacity and aging move jobs between them)."""
    totals: dict[tuple[str, str], float] = {}
    for s in _samples(family, "_total"):
        key = (s.labels["kind"], s.labels["status"])
        totals[key] = totals.get(key, 0.0) + s.value
    return totals


def _wait_final(client: TestClient, job_id: str, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in FINAL:
            return job
        time.sleep(0.1)
    pytest.fail(f"job {job_id} did not finish in {timeout}s")


@pytest.fixture
def stack_settings(make_settings: Callable[..., Settings], demo_checkpoint: Path) -> Settings:
    return make_settings(
        model_dir=demo_checkpoint,
        auth="disabled",
        log_level="INFO",
        worker_metrics_interval=0.3,
        max_attempts=2,
    )


@pytest.fixture
def api(stack_settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(stack_settings)) as client:
        yield client


def test_metrics_after_real_jobs(api: TestClient, stack_settings: Settings, launcher: Any) -> None:
    worker = launcher.start_worker(stack_settings)
    launcher.start_beat(stack_settings)  # the reconciler republishes the retried job
    request_id = f"obs-{uuid.uuid4().hex[:12]}"
    ok_ids = []
    for i in range(3):
        headers = {"X-Request-ID": request_id} if i == 0 else {}
        response = api.post("/v1/jobs", json=JOB_BODY, headers=headers)
        assert response.status_code == 202, response.text
        if i == 0:
            assert response.headers["X-Request-ID"] == request_id
        ok_ids.append(response.json()["id"])
    failing = api.post("/v1/jobs", json={**JOB_BODY, "params": {"max_new_tokens": 8, "fault": "transient"}})
    assert failing.status_code == 202, failing.text
    jobs = [_wait_final(api, job_id) for job_id in ok_ids]
    assert all(job["status"] == "succeeded" for job in jobs), jobs
    failed = _wait_final(api, failing.json()["id"])
    assert failed["status"] == "failed"
    api.get(f"/v1/jobs/{ok_ids[0]}")  # one templated route hit for the HTTP families
    # The worker's counters reach /metrics with its next snapshot (every heartbeat): wait for
    # the one that counts this test's jobs (under CI load a heartbeat can come late).
    deadline = time.monotonic() + 20.0
    while True:
        response = api.get("/metrics")
        family = _families(response.text).get("cloverq_jobs_finished_total")
        counted = _finished_by_kind_and_status(family) if family is not None else {}
        done = counted.get(("generate", "succeeded"), 0) >= 3 and counted.get(("generate", "failed"), 0) >= 1
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = _families(response.text)
    missing = sorted(set(FAMILIES) - set(families))
    assert not missing, f"families not exported: {missing}"
    for name, family in families.items():
        assert family.type == FAMILIES[name].type, name

    submitted = _samples(families["cloverq_jobs_submitted_total"], "_total")
    assert sum(s.value for s in submitted) >= 4
    finished = _finished_by_kind_and_status(families["cloverq_jobs_finished_total"])
    assert finished.get(("generate", "succeeded"), 0) >= 3
    assert finished.get(("generate", "failed"), 0) >= 1
    # Wait and run time are known for every finished job; steps and tokens only for the jobs
    # whose attempt reached the engine (the dead-lettered one failed before it).
    expected = {
        "cloverq_job_queue_wait_seconds": 4,
        "cloverq_job_run_seconds": 4,
        "cloverq_job_steps_used": 3,
        "cloverq_job_tokens": 3,
    }
    for name, n in expected.items():
        counts = _samples(families[name], "_count")
        assert sum(s.value for s in counts) >= n, name
        inf = [s for s in _samples(families[name], "_bucket") if s.labels["le"] == "+Inf"]
        assert sum(s.value for s in inf) == sum(s.value for s in counts), name
    token_sum = sum(s.value for s in _samples(families["cloverq_job_tokens"], "_sum"))
    assert token_sum >= 3  # the succeeded jobs generated tokens
    retries = _samples(families["cloverq_job_retries_total"], "_total")
    assert sum(s.value for s in retries) >= 1
    assert sum(s.value for s in _samples(families["cloverq_dead_letters_total"], "_total")) >= 1

    worker_id = worker.worker_id
    assert worker_id
    by_worker = {s.labels["worker"]: s.value for s in _samples(families["cloverq_worker_batch_occupancy"])}
    assert worker_id in by_worker and 0.0 <= by_worker[worker_id] <= 1.0
    tps = {s.labels["worker"]: s.value for s in _samples(families["cloverq_worker_tokens_per_second"])}
    assert tps[worker_id] >= 0.0
    info = [s for s in _samples(families["cloverq_model_info"]) if s.labels["worker"] == worker_id]
    assert len(info) == 1 and info[0].value == 1 and info[0].labels["version"]
    load = {s.labels["worker"]: s.value for s in _samples(families["cloverq_model_load_seconds"])}
    assert load[worker_id] > 0
    memory = {
        s.labels["kind"]: s.value
        for s in _samples(families["cloverq_device_memory_bytes"])
        if s.labels["worker"] == worker_id
    }
    assert memory["used"] > 0 and memory["total"] >= memory["used"]
    shares: dict[str, float] = {}
    for s in _samples(families["cloverq_expert_token_share"]):
        if s.labels["worker"] == worker_id:
            shares[s.labels["layer"]] = shares.get(s.labels["layer"], 0.0) + s.value
    assert shares and all(abs(total - 1.0) < 1e-6 for total in shares.values()), shares
    imbalance = [
        s.value
        for s in _samples(families["cloverq_expert_load_imbalance"])
        if s.labels["worker"] == worker_id
    ]
    assert imbalance and all(v >= 1.0 for v in imbalance)
    ready = {s.labels["queue"]: s.value for s in _samples(families["cloverq_workers_ready"])}
    assert ready["interactive"] >= 1
    depth = {s.labels["queue"]: s.value for s in _samples(families["cloverq_queue_depth"])}
    assert depth["interactive"] == 0 and set(depth) >= {"interactive", "standard", "bulk", "joint"}
    routes = {
        (s.labels["route"], s.labels["method"], s.labels["status"])
        for s in _samples(families["cloverq_http_requests_total"], "_total")
    }
    assert ("/v1/jobs", "POST", "202") in routes
    assert ("/v1/jobs/{job_id}", "GET", "200") in routes
    assert _samples(families["cloverq_http_request_seconds"], "_count")

    # The request id travelled API -> job row -> worker: its job summary line carries it.
    summary = _summary_lines(worker.log(), ok_ids[0])
    assert summary, worker.log()[-3000:]
    line = summary[-1]
    assert line["request_id"] == request_id
    for field in (
        "kind",
        "queue",
        "attempt",
        "steps_used",
        "step_budget",
        "tokens",
        "model_version",
        "wait_seconds",
        "run_seconds",
    ):
        assert field in line, field
    assert "Observe me" not in worker.log()  # prompts are not logged by default


def _summary_lines(log_text: str, job_id: str) -> list[dict[str, Any]]:
    lines = []
    for raw in log_text.splitlines():
        raw = raw.strip()
        if not raw.startswith("{"):
            continue
        try:
            event = json.loads(raw)
        except ValueError:
            continue
        if event.get("event") == "job.finished" and event.get("job_id") == job_id:
            lines.append(event)
    return lines


def test_recorder_and_collector_on_real_redis(redis_url: str) -> None:
    client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    for key in client.scan_iter("cloverq:metrics:*"):
        client.delete(key)
    recorder = RedisMetricsRecorder(client)
    recorder.job_finished(
        kind="decide",
        queue="joint",
        status="succeeded",
        wait_seconds=0.02,
        run_seconds=3.0,
        steps_used=40,
        tokens=100,
    )
    recorder.job_finished(
        kind="decide",
        queue="joint",
        status="succeeded",
        wait_seconds=20.0,
        run_seconds=0.07,
        steps_used=3,
        tokens=2,
    )
    recorder.invalid_output_retry(kind="decide")
    recorder.publish_worker(WorkerSnapshot(worker="gone", queues=("joint",)), ttl_seconds=0.3)
    recorder.publish_worker(
        WorkerSnapshot(worker="here", queues=("joint",), router_counts=[[3, 1]]), ttl_seconds=30
    )
    time.sleep(0.5)

    body, _ = render_metrics(client)
    families = _families(body.decode())
    wait = families["cloverq_job_queue_wait_seconds"]
    buckets = {s.labels["le"]: s.value for s in _samples(wait, "_bucket") if s.labels["queue"] == "joint"}
    assert buckets["0.01"] == 0 and buckets["0.025"] == 1 and buckets["10.0"] == 1 and buckets["30.0"] == 2
    assert buckets["+Inf"] == 2
    assert _samples(wait, "_sum")[0].value == pytest.approx(20.02)
    invalid = _samples(families["cloverq_invalid_output_retries_total"], "_total")
    assert [(s.labels, s.value) for s in invalid] == [({"kind": "decide"}, 1.0)]
    workers = {s.labels["worker"] for s in _samples(families["cloverq_worker_batch_occupancy"])}
    assert workers == {"here"}  # the expired snapshot is gone
    shares = {s.labels["expert"]: s.value for s in _samples(families["cloverq_expert_token_share"])}
    assert shares == {"0": 0.75, "1": 0.25}
    ready = {s.labels["queue"]: s.value for s in _samples(families["cloverq_workers_ready"])}
    assert ready == {"joint": 1.0}
