"""The worker exec probe (``python -m cli.probe worker [--ready]``) against a real Redis registry.

Kubernetes, compose and Docker run exactly this command in the worker container: readiness
must follow the registry state the worker publishes (ready only after model load + warm-up,
not while draining), liveness must fail once the worker's heartbeat entry is gone, and a Redis
outage must not fail liveness (or every worker would be restarted at once).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from click.testing import CliRunner

from scheduler.fleet.workers import WorkerInfo, WorkerState, list_workers, publish_worker, remove_worker
from scheduler.infra import redis_keys
from scheduler.infra.settings import get_settings

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]


def probe(redis_url: str, *args: str) -> int:
    """Run the probe exactly as a container does (a fresh ``python -m cli.probe`` process)."""
    env = {**os.environ, "CLOVERQ_REDIS_URL": redis_url}
    result = subprocess.run(
        [sys.executable, "-m", "cli.probe", "worker", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        timeout=60,
    )
    return result.returncode


@pytest.fixture
def probe_here(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., int]]:
    """The same command in-process (fast: no interpreter start), for the state matrix."""
    from cli.probe import probe_group

    def run(redis_url: str, *args: str) -> int:
        monkeypatch.setenv("CLOVERQ_REDIS_URL", redis_url)
        get_settings.cache_clear()
        return CliRunner().invoke(probe_group, ["worker", *args]).exit_code

    yield run
    get_settings.cache_clear()


@pytest.fixture
def host() -> str:
    return f"probe-test-{uuid.uuid4().hex[:8]}"


def _publish(client: redis_lib.Redis, host: str, state: str, *, ttl: int = 30) -> WorkerInfo:
    info = WorkerInfo(id=f"cloverq-1@{host}", hostname=host, pid=1, queues=["standard"], state=state)
    publish_worker(client, info, ttl_seconds=ttl)
    return info


def test_probe_follows_the_registry_state(
    redis_url: str, redis_client: redis_lib.Redis, host: str, probe_here: Callable[..., int]
) -> None:
    assert probe(redis_url, "--hostname", host) == 1  # nothing registered: not alive
    assert probe(redis_url, "--ready", "--hostname", host) == 1

    info = _publish(redis_client, host, WorkerState.STARTING)
    assert probe_here(redis_url, "--hostname", host) == 0
    assert probe_here(redis_url, "--ready", "--hostname", host) == 1  # loading: alive, not ready

    _publish(redis_client, host, WorkerState.READY)
    assert probe_here(redis_url, "--ready", "--hostname", host) == 0
    assert probe_here(redis_url, "--ready", "--hostname", "some-other-host") == 1

    _publish(redis_client, host, WorkerState.DRAINING)
    assert probe_here(redis_url, "--hostname", host) == 0
    assert probe_here(redis_url, "--ready", "--hostname", host) == 1  # SIGTERM: no new jobs

    remove_worker(redis_client, info.id)
    assert probe_here(redis_url, "--hostname", host) == 1


def test_liveness_fails_when_the_heartbeat_expires(
    redis_url: str, redis_client: redis_lib.Redis, host: str, probe_here: Callable[..., int]
) -> None:
    info = _publish(redis_client, host, WorkerState.READY)
    assert probe_here(redis_url, "--hostname", host) == 0
    # A hung worker stops refreshing its entry: let the TTL run out now.
    redis_client.pexpire(redis_keys.worker(info.id), 1)
    time.sleep(0.05)
    assert probe_here(redis_url, "--hostname", host) == 1


def test_a_redis_outage_keeps_liveness_but_not_readiness(host: str, probe_here: Callable[..., int]) -> None:
    unreachable = "redis://127.0.0.1:1/0"
    assert probe(unreachable, "--hostname", host) == 0
    assert probe_here(unreachable, "--ready", "--hostname", host) == 1


def test_a_real_worker_is_ready_under_this_hostname(
    celery_worker_process: Callable[..., Any], redis_url: str, redis_client: redis_lib.Redis
) -> None:
    """The probe's one assumption: the worker registers under the host (pod) name."""
    service = celery_worker_process()
    (mine,) = [w for w in list_workers(redis_client) if w.pid == service.pid]
    assert mine.hostname == socket.gethostname() and mine.is_ready
    assert probe(redis_url, "--ready") == 0
