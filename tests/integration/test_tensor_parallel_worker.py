"""A 2-rank worker (``CLOVERQ_TENSOR_PARALLEL=2``, gloo on CPU) serving jobs end to end through the
API, and what a SIGKILL of its rank 1 mid-job costs: the worker exits non-zero (75), its running
jobs come back through lease expiry and the reaper, and after a restart every job finishes with
exactly one outcome write (checked by the chaos tests' audit trigger on a database of its own).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from api.app import create_app
from scheduler.fleet.workers import WorkerInfo, list_workers
from scheduler.infra.settings import Settings
from tests.chaos.conftest import install_outcome_audit
from tests.conftest import ProcessLauncher, _create_postgres_database, wait_for
from worker.tensor_parallel import EXIT_RANK_LOST

pytestmark = pytest.mark.integration

# Two short jobs (~8 denoising passes) that are served end to end early, and long ones (~64 passes)
# still running then: jobs of one length run as one batch and end within the same few passes, so
# "one succeeded and others still running" would last only milliseconds before the kill.
PARAMS: dict[str, Any] = {"block_size": 4, "steps_per_block": 4}
SHORT_JOBS, LONG_JOBS = 2, 6
FINAL = ("succeeded", "failed", "cancelled")


@pytest.fixture
def audited_db(tmp_path: Path) -> Iterator[str]:
    """A migrated database of its own (PostgreSQL when configured) with the outcome-write audit."""
    from scheduler.infra.db import migrate

    base = os.environ.get("CLOVERQ_TEST_DATABASE_URL", "")
    drop: Callable[[], None] = lambda: None  # noqa: E731
    if base.startswith("postgresql"):
        url, drop = _create_postgres_database(base)
    else:
        url = f"sqlite:///{tmp_path / 'tp.db'}"
    migrate(url)
    install_outcome_audit(url)
    yield url
    drop()


def _rows(engine: Any, job_ids: list[str]) -> dict[str, dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, status, attempt, worker_id FROM jobs")).mappings()
        found = {str(row["id"]).replace("-", ""): dict(row) for row in rows}
    return {j: found[j.replace("-", "")] for j in job_ids if j.replace("-", "") in found}


def _writes(engine: Any) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    with engine.connect() as conn:
        for job_id, attempt in conn.execute(text("SELECT job_id, attempt FROM chaos_outcome_writes")):
            out.setdefault(str(job_id).replace("-", ""), []).append(int(attempt))
    return out


def _ready_probe(monkeypatch: pytest.MonkeyPatch, redis_url: str, host: str) -> int:
    """``cloverq probe worker --ready`` as the container runs it (in-process)."""
    from click.testing import CliRunner

    from cli.probe import probe_group
    from scheduler.infra.settings import get_settings

    monkeypatch.setenv("CLOVERQ_REDIS_URL", redis_url)
    get_settings.cache_clear()
    try:
        return CliRunner().invoke(probe_group, ["worker", "--ready", "--hostname", host]).exit_code
    finally:
        get_settings.cache_clear()


def test_two_rank_worker_serves_jobs_and_a_killed_rank_loses_none(
    make_settings: Callable[..., Settings], demo_checkpoint: Path, audited_db: str, redis_url: str,
    launcher: ProcessLauncher, monkeypatch: pytest.MonkeyPatch,
) -> None:
    isolated = redis_url.rsplit("/", 1)[0] + "/9"  # queues of their own: no other test's messages
    redis_lib.Redis.from_url(isolated).flushdb()
    settings = make_settings(database_url=audited_db, redis_url=isolated, model_dir=demo_checkpoint,
                             tensor_parallel=2, auth="disabled", rate_limit_per_second=0,
                             tenant_max_active_jobs=100_000, skip_verify=True)
    client_redis = redis_lib.Redis.from_url(isolated, decode_responses=True)
    launcher.start_beat(settings)
    worker = launcher.start_worker(settings)
    info: WorkerInfo = next(w for w in list_workers(client_redis) if w.pid == worker.pid)
    tp = info.stats["tensor_parallel"]
    assert (tp["size"], tp["ranks_ready"], tp["backend"]) == (2, 2, "gloo")
    rank1 = tp["pids"][1]
    assert tp["pids"][0] == worker.pid and rank1 != worker.pid
    assert _ready_probe(monkeypatch, isolated, info.hostname) == 0  # every rank up: ready
    sql = create_engine(audited_db)
    try:
        with TestClient(create_app(settings)) as client:
            body = {"kind": "generate", "input": {"prompt": "The quick brown fox"}}
            job_ids = [client.post("/v1/jobs", json={**body, "params": {
                **PARAMS, "seed": i, "max_new_tokens": 8 if i < SHORT_JOBS else 64}}).json()["id"]
                for i in range(SHORT_JOBS + LONG_JOBS)]

        def mid_run() -> bool:  # some served end to end, some running on the worker right now
            statuses = [r["status"] for r in _rows(sql, job_ids).values()]
            return statuses.count("succeeded") >= 1 and "running" in statuses

        wait_for(mid_run, timeout=60, interval=0.02, message="jobs served and others running")
        os.kill(rank1, signal.SIGKILL)
        assert worker.proc.wait(timeout=20) == EXIT_RANK_LOST, worker.log()[-3000:]
        # what the dead worker held (its leases run out 3 s later; the reaper requeues them then)
        held = [j for j, r in _rows(sql, job_ids).items()
                if r["status"] == "running" and r["worker_id"] == info.id]
        gone = [w for w in list_workers(client_redis) if w.pid == worker.pid]
        assert all(w.state == "failed" for w in gone)
        assert _ready_probe(monkeypatch, isolated, info.hostname) == 1  # not ready in the meantime
        assert "worker.tensor_parallel_lost" in worker.log()

        began = time.monotonic()
        launcher.start_worker(settings)  # what the supervisor / Kubernetes does
        wait_for(lambda: all(r["status"] in FINAL for r in _rows(sql, job_ids).values())
                 and len(_rows(sql, job_ids)) == len(job_ids), timeout=90, interval=0.2,
                 message="every job final after the restart")
        rows, writes = _rows(sql, job_ids), _writes(sql)
        assert {r["status"] for r in rows.values()} == {"succeeded"}, rows
        for job_id, row in rows.items():
            assert writes.get(job_id.replace("-", "")) == [row["attempt"]], (job_id, row, writes)
        assert held and all(rows[j]["attempt"] == 2 for j in held)  # re-run after the reaper, once
        print(f"killed rank 1 holding {len(held)} running jobs; all {len(job_ids)} succeeded once, "
              f"{time.monotonic() - began:.1f}s after the restart began")
    finally:
        sql.dispose()
