"""Metric families: the name contract, expert shares, multiprocess merging (no Redis needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scheduler.observability.metric_families import FAMILIES
from scheduler.observability.metrics_recorder import WorkerSnapshot, _bucket_index

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_every_family_is_prefixed_and_typed() -> None:
    assert len(FAMILIES) > 10  # the registry is populated
    for name, spec in FAMILIES.items():
        assert name.startswith("cloverq_"), name
        assert spec.type in ("counter", "gauge", "histogram")
        assert (spec.type == "counter") == name.endswith("_total"), name
        assert bool(spec.buckets) == (spec.type == "histogram"), name
        assert list(spec.buckets) == sorted(spec.buckets), name


def test_bucket_index_uses_upper_inclusive_bounds() -> None:
    buckets = (1.0, 2.0, 4.0)
    assert [_bucket_index(buckets, v) for v in (0.5, 1.0, 1.5, 4.0, 9.0)] == [0, 0, 1, 2, 3]


def test_expert_share_and_imbalance() -> None:
    payload = WorkerSnapshot(worker="w", router_counts=[[1, 1, 2, 0], [0, 0, 0, 0]]).to_payload()
    assert payload["expert_share"] == {"0": [0.25, 0.25, 0.5, 0.0]}  # layer 1 routed nothing: omitted
    assert payload["expert_imbalance"] == {"0": 2.0}  # max / mean


_RECORD = (
    "from scheduler.observability.process_metrics import record_submitted, record_http_request\n"
    "record_submitted(kind='generate', queue='standard')\n"
    "record_http_request(route='/v1/jobs', method='POST', status=202, seconds=0.01)\n"
)
_RENDER = (
    "import sys\n"
    "from pathlib import Path\n"
    "from scheduler.observability.cluster_metrics import render_metrics\n"
    "body, _ = render_metrics(None, multiproc_dir=Path(sys.argv[1]))\n"
    "sys.stdout.write(body.decode())\n"
)


def test_multiprocess_mode_sums_api_processes(tmp_path: Path) -> None:
    """Two API processes on one host count into the mmap dir; a third one's /metrics sums them."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for _ in range(2):
        subprocess.run([sys.executable, "-c", _RECORD], cwd=REPO_ROOT, env=env, check=True, timeout=60)
    out = subprocess.run(
        [sys.executable, "-c", _RENDER, str(tmp_path)],
        cwd=REPO_ROOT,
        env=env,
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    ).stdout
    families = {f.name: f for f in text_string_to_metric_families(out)}
    submitted = families["cloverq_jobs_submitted"].samples
    assert [(s.labels, s.value) for s in submitted] == [({"kind": "generate", "queue": "standard"}, 2.0)]
    counts = [s for s in families["cloverq_http_request_seconds"].samples if s.name.endswith("_count")]
    assert counts and counts[0].value == 2.0


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_has_help(name: str) -> None:
    assert len(FAMILIES[name].help) > 10


def test_scrape_survives_redis_and_database_outages() -> None:
    """A dead Redis and a failing SQL query drop only their families; /metrics still answers."""
    import redis

    from scheduler.observability.cluster_metrics import render_metrics
    from scheduler.observability.process_metrics import record_submitted

    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, socket_timeout=0.2)

    def broken_depths() -> dict[str, int]:
        raise RuntimeError("database is down")

    record_submitted(kind="generate", queue="bulk")
    body, _ = render_metrics(dead, queue_depths=broken_depths)
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert "cloverq_jobs_submitted" in names
    assert "cloverq_jobs_finished" not in names and "cloverq_queue_depth" not in names
