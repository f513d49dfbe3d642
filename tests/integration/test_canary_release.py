"""A canary release with REAL worker processes, Redis, SQL and beat: 400 jobs at 10 %.

Two workers serve store model ``canarydemo``: one ``stable`` and one ``canary``
(``CLOVERQ_MODEL_TRACK``). v1 and v2 are the tiny demo model with different seeds, so a job's
text tells which weights produced it. 400 tiny jobs are submitted while a 10 % canary of v2 is in
effect; it is aborted in the middle of the first 200 and, after it is started again, promoted in
the middle of the last 200. Checked:

- the share pinned to the canary at submit is 10 % within 5 points;
- every job succeeded on its first attempt (nothing lost, nothing retried);
- every job ran on the version it was pinned to when it was claimed, and the worker that ran it
  served that version: its recorded ``model_version`` carries the version's manifest digest and
  its text is the one that version's weights produce;
- the promotion gate refuses too small a canary, the admin API shows the canary.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.app import create_app
from scheduler.access.api_keys import create_key
from scheduler.fleet.workers import list_workers
from scheduler.infra.db import make_engine, session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job
from tests.conftest import ProcessLauncher, wait_for
from worker import model_store
from worker.model.demo import write_demo_checkpoint

pytestmark = pytest.mark.integration

MODEL = "canarydemo"
TENANT = "ops-canary"
TOTAL = 400
TINY_JOB = {"kind": "generate", "input": {"prompt": "Canary:"},
            "params": {"max_new_tokens": 3, "steps_per_block": 1, "temperature": 0}}


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("canary-store")
    sources = tmp_path_factory.mktemp("canary-sources")
    for version, seed in (("v1", 0), ("v2", 1)):
        src = write_demo_checkpoint(sources / version, seed=seed, size="tiny")
        model_store.pull(src, name=MODEL, version=version, root=root)
    return root


@pytest.fixture(scope="module")
def stack_settings(make_settings: Any, store_root: Path) -> Settings:
    return make_settings(
        served_model=MODEL, served_model_initial_version="v1", model_root=store_root, engine_max_batch=8,
        model_dir=store_root / MODEL / "v1", model_watch_interval_seconds=0.2,
        worker_queues="interactive,standard,bulk", rate_limit_per_second=0, canary_min_jobs=5,
    )


@pytest.fixture(scope="module")
def api(stack_settings: Settings) -> Iterator[tuple[TestClient, dict[str, str]]]:
    with session_factory(make_engine(stack_settings.resolved_database_url))() as session:
        key = create_key(session, tenant=TENANT, scopes=["admin", "submit", "read"]).key
    with TestClient(create_app(stack_settings)) as client:
        yield client, {"Authorization": f"Bearer {key}"}


def digest(store_root: Path, version: str) -> str:
    """The manifest digest prefix a worker records for ``version`` (``<version>@<digest[:12]>``)."""
    from worker.model.manifest import manifest_digest

    return manifest_digest(store_root / MODEL / version)[:12]


def serving(redis_url: str) -> dict[int, tuple[str, str, str | None]]:
    """pid -> (state, served version, lane) of every worker of the registry."""
    client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    return {w.pid: (w.state, (w.model_version or "").split("@")[0], w.stats.get("lane"))
            for w in list_workers(client)}


def post(client: TestClient, headers: dict[str, str], path: str, body: Any = None,
         status: int = 200) -> dict[str, Any]:
    response = client.post(f"/v1/admin/models/{MODEL}/{path}", json=body, headers=headers)
    assert response.status_code == status, response.text
    return dict(response.json())


class Traffic(threading.Thread):
    """Submits ``total`` tiny jobs from a few threads; ``reached(n)`` waits for n submitted."""

    def __init__(self, client: TestClient, headers: dict[str, str], total: int, threads: int = 3) -> None:
        super().__init__(daemon=True)
        self.client, self.headers, self.total, self.threads = client, headers, total, threads
        self.submitted: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._left = total

    def _one(self) -> None:
        while True:
            with self._lock:
                if self._left == 0 or self.errors:
                    return
                self._left -= 1
            response = self.client.post("/v1/jobs", json=TINY_JOB, headers=self.headers)
            with self._lock:
                if response.status_code != 202:
                    self.errors.append(response.text)
                else:
                    self.submitted.append(response.json())

    def run(self) -> None:
        pool = [threading.Thread(target=self._one, daemon=True) for _ in range(self.threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()

    def reached(self, n: int) -> bool:
        assert not self.errors, self.errors[:1]
        return len(self.submitted) >= n


def in_flight(settings: Settings) -> int:
    """Jobs of this test's tenant still queued or running."""
    with session_factory(make_engine(settings.resolved_database_url))() as session:
        return int(session.scalar(select(func.count()).select_from(Job).where(
            Job.tenant == TENANT, Job.status.in_(("queued", "running")))) or 0)


def test_canary_400_jobs_abort_and_promote_mid_traffic(
    api: tuple[TestClient, dict[str, str]], launcher: ProcessLauncher, stack_settings: Settings,
    store_root: Path, redis_url: str,
) -> None:
    client, headers = api
    began = time.monotonic()
    stable = launcher.start_worker(stack_settings, concurrency=8, wait_ready=False)
    canary = launcher.start_worker(stack_settings.replaced(model_track="canary"),
                                   concurrency=4, wait_ready=False)
    launcher.start_beat(stack_settings)
    for worker in (stable, canary):
        launcher.wait_ready(worker, stack_settings, timeout=120)

    started = post(client, headers, "canary", {"version": "v2", "percent": 10})
    assert (started["canary"]["version"], started["canary"]["percent"]) == ("v2", 10.0)
    assert post(client, headers, "canary", {"version": "v1", "percent": 5}, status=409)["error"]["code"]
    wait_for(lambda: serving(redis_url).get(canary.pid) == ("ready", "v2", "canary"), timeout=60,
             interval=0.05, message="the canary worker ready on v2 (canary lanes)")

    ready_at = time.monotonic() - began
    traffic = Traffic(client, headers, TOTAL)
    traffic.start()
    # Abort mid-traffic, then start the canary again at once (routing resumes).
    wait_for(lambda: traffic.reached(120), timeout=60, interval=0.02, message="120 jobs submitted")
    aborted = post(client, headers, "abort")
    assert aborted["canary"] is None and aborted["active_version"] == "v1"
    at_abort = in_flight(stack_settings)
    post(client, headers, "canary", {"version": "v2", "percent": 10})
    refused = post(client, headers, "promote", status=409)["error"]  # no canary job finished since
    assert refused["code"] == "canary_gate_refused" and refused["details"]["canary"]["finished"] < 5, refused
    # Promote mid-traffic once the gate passes and most jobs are in.
    wait_for(lambda: traffic.reached(320) and gate_ok(client, headers), timeout=90, interval=0.05,
             message="320 jobs submitted and the promotion gate passing")
    side_by_side(client, headers)  # the dashboard's data while both versions serve
    promoted = post(client, headers, "promote", {"force": False})
    assert promoted["active_version"] == "v2" and promoted["canary"] is None
    at_promote = in_flight(stack_settings)
    traffic.join(timeout=120)
    assert traffic.reached(TOTAL) and len(traffic.submitted) == TOTAL

    ids = [uuid.UUID(j["id"]) for j in traffic.submitted]
    wait_for(lambda: in_flight(stack_settings) == 0, timeout=120, interval=0.2, message="every job to finish")
    done_at = time.monotonic() - began
    pinned = [j for j in traffic.submitted if j["routed_version"] is not None]
    share = sum(j["routed_version"] == "v2" for j in pinned) / len(pinned)
    print(f"canary share at submit: {share:.3f} of {len(pinned)} pinned jobs; "
          f"in flight at abort {at_abort}, at promote {at_promote}; workers ready after {ready_at:.1f}s, "
          f"all {TOTAL} jobs done after {done_at:.1f}s")
    assert abs(share - 0.10) <= 0.05, share

    with session_factory(make_engine(stack_settings.resolved_database_url))() as session:
        rows = session.execute(select(Job.id, Job.status, Job.attempt, Job.model_version, Job.routed_version,
                                      Job.worker_id, Job.result).where(Job.id.in_(ids))).all()
    assert len(rows) == TOTAL
    lost = [r for r in rows if r.status != "succeeded" or r.attempt != 1]
    assert lost == [], lost[:3]  # nothing lost, failed or retried
    digests = {"v1": digest(store_root, "v1"), "v2": digest(store_root, "v2")}
    texts: dict[str, set[str]] = {"v1": set(), "v2": set()}
    for row in rows:
        version, _, recorded = row.model_version.partition("@")
        assert recorded == digests[version], row  # the weights the worker had loaded at claim
        if row.routed_version is not None:
            assert version == row.routed_version, row  # never another version than its pin
        texts[version].add(row.result["text"])
    assert len(texts["v1"]) == len(texts["v2"]) == 1 and texts["v1"] != texts["v2"], texts
    assert {r.worker_id for r in rows} == {stable.worker_id, canary.worker_id}
    wait_for(lambda: {serving(redis_url).get(w.pid, ("", "", None))[1] for w in (stable, canary)} == {"v2"},
             timeout=60, interval=0.1, message="the whole fleet on v2")


def side_by_side(client: TestClient, headers: dict[str, str]) -> None:
    """During the canary: the dashboard's overview and ``/metrics`` show both versions."""
    overview = client.get("/v1/admin/overview", headers=headers).json()
    rows = {(v["version"], v["track"]): v for v in overview["versions"]}
    assert rows[("v2", "canary")]["jobs"] > 0 and rows[("v1", "stable")]["jobs"] > 0, overview["versions"]
    assert [v["track"] for v in overview["versions"]][:2] == ["canary", "stable"]  # canary first
    assert {"model": MODEL, "stable": "v1", "canary": "v2", "percent": 10.0} in overview["canaries"]
    from prometheus_client.parser import text_string_to_metric_families

    exposition = client.get("/metrics").text
    samples = {(m.name, tuple(sorted(m.labels.items()))): m.value
               for family in text_string_to_metric_families(exposition) for m in family.samples}
    for track, version in (("canary", "v2"), ("stable", "v1")):
        finished = ("cloverq_version_jobs_finished_total",
                    (("status", "succeeded"), ("track", track), ("version", version)))
        assert samples.get(finished, 0) > 0, finished
    run_count = ("cloverq_version_job_run_seconds_count", (("track", "canary"), ("version", "v2")))
    assert samples.get(run_count, 0) > 0


def gate_ok(client: TestClient, headers: dict[str, str]) -> bool:
    response = client.get(f"/v1/admin/models/{MODEL}/canary", headers=headers)
    assert response.status_code == 200, response.text
    return bool(response.json()["gate"]["ok"])
