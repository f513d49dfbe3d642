"""Switching the active model version with REAL worker processes, Redis, SQL and beat.

One stack per module: a model store with two versions of the tiny demo model (different seeds,
published by ``model_store.pull``), beat (the reconciler republishes messages a switching worker
hands back), and workers that serve store model ``demo`` (``served_model``).

- activating v2 while jobs run fails none of them: running jobs finish on v1 (first attempt),
  every job after the switch records v2, the worker is ``switching`` (not ready) in between;
- rollback = activating v1 again: nothing copied (same inodes, same store listing);
- a version that fails verification leaves the worker serving the version it had;
- with two workers the switch rolls: at every moment at least one worker is ready.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient

from api.app import create_app
from scheduler.access.api_keys import create_key
from scheduler.fleet.workers import list_workers
from scheduler.infra.db import make_engine, session_factory
from scheduler.infra.settings import Settings
from tests.conftest import ProcessLauncher, wait_for
from worker import model_store
from worker.model.demo import write_demo_checkpoint

pytestmark = pytest.mark.integration

MODEL = "demo"
FINAL = {"succeeded", "failed", "cancelled", "expired"}
# Long enough that a job is still running when the activation lands (tiny model on CPU).
LONG_JOB = {"kind": "generate", "input": {"prompt": "Clause 1:"},
            "params": {"max_new_tokens": 384, "steps_per_block": 8, "temperature": 0}}
SHORT_JOB = {"kind": "generate", "input": {"prompt": "Clause 2:"}, "params": {"max_new_tokens": 8}}


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model store holding demo/v1 (seed 0) and demo/v2 (seed 1), published by a real pull."""
    root = tmp_path_factory.mktemp("store")
    sources = tmp_path_factory.mktemp("sources")
    for version, seed in (("v1", 0), ("v2", 1)):
        src = write_demo_checkpoint(sources / version, seed=seed, size="tiny")
        model_store.pull(src, name=MODEL, version=version, root=root)
    return root


@pytest.fixture(scope="module")
def stack_settings(make_settings: Any, store_root: Path) -> Settings:
    return make_settings(
        served_model=MODEL, served_model_initial_version="v1", model_root=store_root,
        model_dir=store_root / MODEL / "v1",  # the API's tokenizer (prompt-length checks)
        model_watch_interval_seconds=0.3, worker_queues="interactive,standard,bulk",
    )


@pytest.fixture(scope="module")
def api(stack_settings: Settings) -> Iterator[tuple[TestClient, dict[str, str]]]:
    with session_factory(make_engine(stack_settings.resolved_database_url))() as session:
        key = create_key(session, tenant="ops-models", scopes=["admin", "submit", "read"]).key
    with TestClient(create_app(stack_settings)) as client:
        yield client, {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def beat(stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Stopped when this module ends: a session-lived beat went on consuming the shared Redis's
    maintenance and ``webhooks`` queues with THIS module's settings during later modules (it made
    tests/integration/test_webhooks_delivery.py retry a delivery 5 times, the default, not 3)."""
    launcher = ProcessLauncher(tmp_path_factory.mktemp("beat-logs"))
    try:
        yield launcher.start_beat(stack_settings)
    finally:
        launcher.close()


def submit(client: TestClient, headers: dict[str, str], body: dict[str, Any]) -> str:
    response = client.post("/v1/jobs", json=body, headers=headers)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def job(client: TestClient, headers: dict[str, str], job_id: str) -> dict[str, Any]:
    response = client.get(f"/v1/jobs/{job_id}", headers=headers)
    assert response.status_code == 200, response.text
    return dict(response.json())


def wait_final(
    client: TestClient, headers: dict[str, str], ids: list[str], timeout: float = 120
) -> list[dict[str, Any]]:
    wait_for(lambda: all(job(client, headers, i)["status"] in FINAL for i in ids), timeout=timeout,
             interval=0.2, message="jobs to finish")
    return [job(client, headers, i) for i in ids]


def activate(client: TestClient, headers: dict[str, str], version: str) -> dict[str, Any]:
    response = client.post(f"/v1/admin/models/{MODEL}/activate", json={"version": version}, headers=headers)
    assert response.status_code == 200, response.text
    return dict(response.json())


def served(redis_url: str, pid: int) -> tuple[str, str | None]:
    """(state, version) of worker ``pid`` in the registry."""
    client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    for info in list_workers(client):
        if info.pid == pid:
            return info.state, (info.model_version or "").split("@")[0] or None
    return "absent", None


def switch_error(client: TestClient, headers: dict[str, str], pid: int) -> str | None:
    """The failed-switch reason the admin worker list shows for worker ``pid``."""
    workers = client.get("/v1/admin/workers", headers=headers).json()["items"]
    return next((w["model_switch_error"] for w in workers if w["pid"] == pid), None)


def wait_serving(redis_url: str, pid: int, version: str, timeout: float = 90) -> None:
    wait_for(lambda: served(redis_url, pid) == ("ready", version), timeout=timeout, interval=0.1,
             message=f"worker {pid} ready on {version}")


class StateRecorder(threading.Thread):
    """Samples every worker's registry state while a switch happens."""

    def __init__(self, redis_url: str) -> None:
        super().__init__(daemon=True)
        self.client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
        self.samples: list[dict[int, tuple[str, str | None]]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.samples.append({w.pid: (w.state, (w.model_version or "").split("@")[0])
                                 for w in list_workers(self.client)})
            time.sleep(0.05)


def store_snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under the store with (inode, mtime_ns): a copy or rewrite would change it."""
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def test_unknown_version_and_scope(api: tuple[TestClient, dict[str, str]], stack_settings: Settings) -> None:
    client, headers = api
    missing = client.post(f"/v1/admin/models/{MODEL}/activate", json={"version": "v9"}, headers=headers)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_version_not_found"
    bad = client.post(f"/v1/admin/models/{MODEL}/activate", json={"version": "../v1"}, headers=headers)
    assert bad.status_code == 422
    with session_factory(make_engine(stack_settings.resolved_database_url))() as session:
        plain = create_key(session, tenant="ops-models", scopes=["submit", "read"]).key
    refused = client.post(f"/v1/admin/models/{MODEL}/activate", json={"version": "v2"},
                          headers={"Authorization": f"Bearer {plain}"})
    assert refused.status_code == 403
    assert client.get("/v1/admin/models", headers={"Authorization": f"Bearer {plain}"}).status_code == 403


def test_switch_while_jobs_run_then_roll_back(
    api: tuple[TestClient, dict[str, str]], beat: Any, launcher: ProcessLauncher, stack_settings: Settings,
    store_root: Path, redis_url: str,
) -> None:
    client, headers = api
    worker = launcher.start_worker(stack_settings, concurrency=4)
    assert served(redis_url, worker.pid) == ("ready", "v1")  # initial version activated at first start
    models = client.get("/v1/admin/models", headers=headers).json()["items"]
    [demo] = [m for m in models if m["name"] == MODEL]
    assert demo["active_version"] == "v1"
    assert [v["ready_workers"] for v in demo["versions"] if v["version"] == "v1"] == [1]
    before = store_snapshot(store_root)

    # Jobs running on v1 when v2 is activated.
    running = [submit(client, headers, LONG_JOB) for _ in range(3)]
    wait_for(lambda: any(job(client, headers, i)["status"] == "running" for i in running), timeout=60,
             interval=0.05, message="a job running on v1")
    recorder = StateRecorder(redis_url)
    recorder.start()
    activated_at = datetime.now(UTC)
    answer = activate(client, headers, "v2")
    assert answer["active_version"] == "v2" and answer["previous_version"] == "v1"
    during = [submit(client, headers, SHORT_JOB) for _ in range(4)]  # queued while it switches
    wait_serving(redis_url, worker.pid, "v2")
    recorder.halt.set()
    recorder.join()
    after = [submit(client, headers, SHORT_JOB) for _ in range(3)]

    finished = wait_final(client, headers, running + during + after)
    assert [j["status"] for j in finished] == ["succeeded"] * len(finished), finished
    by_id = {j["id"]: j for j in finished}
    started_on_v1 = [by_id[i] for i in running if by_id[i]["model_version"].startswith("v1@")]
    assert started_on_v1, "a job that was running at activation must finish on v1"
    assert all(j["attempt"] == 1 for j in started_on_v1)  # drained, never interrupted or retried
    # At least one of them was still running when v2 was activated, and finished on v1 after.
    spanning = [j for j in started_on_v1
                if datetime.fromisoformat(j["timings"]["finished_at"]) > activated_at]
    assert spanning, [(j["timings"], activated_at) for j in started_on_v1]
    assert all(by_id[i]["model_version"].startswith("v2@") for i in after)
    assert all(by_id[i]["model_version"].split("@")[0] in {"v1", "v2"} for i in during)
    states = [sample[worker.pid][0] for sample in recorder.samples if worker.pid in sample]
    assert "switching" in states, states  # not ready while it drained and loaded

    ready = client.get("/readyz").json()
    assert ready["ready_workers"].get("interactive") == 1, ready
    workers = client.get("/v1/admin/workers", headers=headers).json()
    assert workers["ready_per_queue"].get("interactive") == 1, workers

    # Rollback: activate the previous version; the store is untouched.
    back = activate(client, headers, "v1")
    assert back["active_version"] == "v1" and back["previous_version"] == "v2"
    wait_serving(redis_url, worker.pid, "v1")
    again = submit(client, headers, SHORT_JOB)
    [rolled] = wait_final(client, headers, [again])
    assert rolled["status"] == "succeeded" and rolled["model_version"].startswith("v1@")
    assert store_snapshot(store_root) == before  # same files, same inodes: nothing was copied
    versions = {v["version"]: v for v in next(m for m in client.get("/v1/admin/models", headers=headers)
                                                .json()["items"] if m["name"] == MODEL)["versions"]}
    assert versions["v1"]["path"] == str(store_root / MODEL / "v1") and versions["v1"]["active"]
    assert not versions["v2"]["active"]

    # A version that fails verification: the worker reloads the one it had and keeps serving.
    broken = store_root / MODEL / "v3-broken"
    shutil.copytree(store_root / MODEL / "v1", broken)
    weights = next(broken.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    try:
        activate(client, headers, "v3-broken")
        reason = wait_for(lambda: switch_error(client, headers, worker.pid), timeout=60, interval=0.1,
                          message="the failed switch to be reported")
        assert reason.startswith("v3-broken"), reason
        wait_serving(redis_url, worker.pid, "v1")
        [still] = wait_final(client, headers, [submit(client, headers, SHORT_JOB)])
        assert still["status"] == "succeeded" and still["model_version"].startswith("v1@")
    finally:
        activate(client, headers, "v1")
        shutil.rmtree(broken)


def test_two_workers_switch_one_at_a_time(
    api: tuple[TestClient, dict[str, str]], beat: Any, launcher: ProcessLauncher, stack_settings: Settings,
    redis_url: str,
) -> None:
    client, headers = api
    first = launcher.start_worker(stack_settings, concurrency=2, wait_ready=False)
    second = launcher.start_worker(stack_settings, concurrency=2, wait_ready=False)
    for service in (first, second):  # both load at once
        launcher.wait_ready(service, stack_settings, timeout=120)
    # Read after the workers are up: a worker's first start registers and activates the initial
    # version, so this test does not depend on an earlier test of the module having run.
    current = client.get("/v1/admin/models", headers=headers).json()["items"]
    start_version = next(m for m in current if m["name"] == MODEL)["active_version"]
    target = "v2" if start_version == "v1" else "v1"
    recorder = StateRecorder(redis_url)
    recorder.start()
    jobs = [submit(client, headers, SHORT_JOB) for _ in range(6)]
    activate(client, headers, target)
    wait_serving(redis_url, first.pid, target)
    wait_serving(redis_url, second.pid, target)
    recorder.halt.set()
    recorder.join()
    finished = wait_final(client, headers, jobs)
    assert [j["status"] for j in finished] == ["succeeded"] * len(finished), finished
    pids = {first.pid, second.pid}
    samples = [s for s in recorder.samples if pids <= set(s)]
    assert samples
    switching_seen = [s for s in samples if any(s[p][0] == "switching" for p in pids)]
    assert switching_seen, "each worker goes through 'switching'"
    never_dark = all(any(s[p][0] == "ready" for p in pids) for s in samples)
    assert never_dark, "both workers were switching at once"
    # Leave the module's model where this test found it (the tests of a module may run in any order).
    activate(client, headers, start_version)
    wait_serving(redis_url, first.pid, start_version)
