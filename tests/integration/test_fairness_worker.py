"""Fair share on a real one-slot worker: a second tenant's batch interleaves with a backlog.

Tenant A submits a 40-job bulk batch, then tenant B a 10-job one while A is backlogged. The
worker runs one job at a time (one task thread, an engine batch of one), so the order in which
jobs START is the scheduling decision. First in, first out, B's jobs would start 41st to 50th;
with fair share (a window of 2 messages, released by DRR as the worker takes them) they alternate
with A's from the moment B arrives. The small-scale twin of ``python -m bench.fair``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import select

from scheduler.batches.service import JobSpec, create_batch, publish_batch
from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.db import get_session_factory
from scheduler.jobs.models import Job, JobStatus
from tests.conftest import ProcessLauncher, clear_leftover_jobs, wait_for

pytestmark = pytest.mark.integration

SPEC = JobSpec(kind="generate", input={"prompt": "Once"}, params={"max_new_tokens": 4, "steps_per_block": 1})


@pytest.fixture(scope="module")
def settings(make_settings: Any, demo_checkpoint: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    settings = make_settings(model_dir=demo_checkpoint, engine_max_batch=1, fair_share_window=2,
                             tenant_max_active_jobs=10_000)
    clear_leftover_jobs(settings)
    launcher = ProcessLauncher(tmp_path_factory.mktemp("fair-logs"))
    launcher.start_worker(settings, queues="bulk", concurrency=1, timeout=180)
    yield settings
    launcher.close()
    clear_leftover_jobs(settings)


def test_a_second_tenants_batch_interleaves_instead_of_finishing_last(settings: Any) -> None:
    sessions = get_session_factory(settings.resolved_database_url)
    app = create_celery_app(settings)
    client = redis_lib.Redis.from_url(settings.resolved_redis_url)
    batches = {}
    for tenant, n in (("fair-a", 40), ("fair-b", 10)):
        with sessions() as session:
            batch, jobs = create_batch(session, tenant=tenant, specs=[SPEC] * n, settings=settings)
        publish_batch(jobs, app=app, redis_client=client, settings=settings, sessions=sessions)
        batches[tenant] = batch.id

    def finished() -> list[Any] | None:
        with sessions() as session:
            rows = session.execute(select(Job.tenant, Job.status, Job.started_at)
                                   .where(Job.batch_id.in_(list(batches.values())))).all()
        return list(rows) if all(row.status == JobStatus.SUCCEEDED.value for row in rows) else None

    rows = wait_for(finished, timeout=120, interval=0.5, message="both batches to finish")
    order = [row.tenant for row in sorted(rows, key=lambda row: row.started_at)]
    ranks = [rank for rank, tenant in enumerate(order) if tenant == "fair-b"]
    assert len(order) == 50 and len(ranks) == 10
    # FIFO: ranks 40..49. Fair share: B starts within a window of its arrival and alternates.
    assert ranks[-1] < 30, order
    assert max(b - a for a, b in itertools.pairwise(ranks)) <= 3, order
