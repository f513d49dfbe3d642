"""The fleet under load while its processes restart: a short run of ``python -m bench.fleet``.

The same script as the benchmark (``bench/fleet.py``, issue 32), shortened for CI: 3 API replicas
behind HAProxy, 2 workers, 2 beats, Redis master + replica + 3 sentinels and a PostgreSQL of its
own, all started and stopped by the script on loopback; fewer clients and a shorter run, with one
restart of each kind (an API replica, a worker, the beat leader, a Redis failover through
Sentinel, a PostgreSQL restart). Asserted on the script's own report: every accepted job ended
exactly once (SQL), no 5xx other than a 503 with ``Retry-After``, no duplicate periodic work
(dispatches per task counted from the beats' own log lines).
"""

from __future__ import annotations

import shutil
import time

import pytest

from bench.fleet import FleetOptions, render, run_fleet
from bench.fleet_services import postgres_bin_dir, redis_server_binary

pytestmark = [
    pytest.mark.integration, pytest.mark.chaos,
    pytest.mark.skipif(shutil.which("haproxy") is None,
                       reason="haproxy not installed (apt-get install -y haproxy)"),
    pytest.mark.skipif(postgres_bin_dir() is None,
                       reason="no PostgreSQL server binaries (apt-get install -y postgresql)"),
    pytest.mark.skipif(redis_server_binary() is None,
                       reason="no redis-server (apt-get install -y redis-server)"),
]

SHORT_EVENTS = ("api2", "worker1", "beat-leader", "redis-failover", "postgres")


def test_short_fleet_run_every_job_once_no_5xx_no_duplicate_periodic_work() -> None:
    began = time.monotonic()
    options = FleetOptions(seconds=12, clients=16, events=SHORT_EVENTS, warmup_seconds=2, wait_ready=False)
    report = run_fleet(options, say=lambda line: print(line, flush=True))
    print(render(report))
    print(f"short fleet run: {time.monotonic() - began:.1f} s in all")
    jobs, errors, periodic = report["jobs"], report["errors"], report["periodic"]
    assert jobs["accepted"] > 0
    assert jobs["ok"], jobs  # each accepted job in SQL, succeeded, one outcome write, a result
    assert jobs["jobs_in_sql_unknown_to_clients"] == 0
    assert errors["ok"], errors["forbidden_5xx"]  # 5xx only as 503 + Retry-After
    assert not report["submits_given_up"]
    duplicated = {name: row for name, row in periodic["tasks"].items() if not row["ok"]}
    assert periodic["ok"], (periodic["leader_changes"], duplicated)  # no duplicate periodic work
    assert periodic["leader_changes"] >= 1  # the leader's restart handed over
    reconcile = periodic["tasks"]["reconcile"]
    assert reconcile["dispatched"] >= 0.8 * reconcile["expected_about"]  # it kept running throughout
    assert report["ok"]
