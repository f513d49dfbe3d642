"""KEDA scales workers on Redis list lengths: those lists must be where Celery puts the jobs.

deploy/k8s/keda.yaml assumes that, with Celery's Redis transport as cloverq configures it, a
job published to queue Q waits in the Redis list named Q. This publishes through the real
publish path (``scheduler.jobs.enqueue.publish_job`` on the real Celery app) into a real Redis and
reads the list lengths the ScaledObjects read.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib
import yaml

from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.settings import Settings
from scheduler.jobs.enqueue import publish_job
from scheduler.jobs.models import QueueName

pytestmark = pytest.mark.integration

KEDA = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "keda.yaml"
ISOLATED_DB = 15  # no worker of the test session consumes here, so nothing drains the lists


@pytest.fixture
def isolated_redis_url(redis_url: str) -> Iterator[str]:
    url = redis_lib.connection.parse_url(redis_url)
    base = redis_url.rsplit("/", 1)[0] if url.get("db") is not None else redis_url.rstrip("/")
    isolated = f"{base}/{ISOLATED_DB}"
    client = redis_lib.Redis.from_url(isolated)
    client.flushdb()
    yield isolated
    client.flushdb()
    client.close()


def test_scaled_object_lists_are_the_celery_queues(isolated_redis_url: str, tmp_path: Path) -> None:
    settings = Settings(redis_url=isolated_redis_url, data_dir=tmp_path)
    app = create_celery_app(settings)
    client = redis_lib.Redis.from_url(isolated_redis_url, decode_responses=True)
    try:
        per_queue = {QueueName.INTERACTIVE.value: 1, QueueName.STANDARD.value: 2, QueueName.BULK.value: 3}
        per_queue[QueueName.JOINT.value] = 4
        for queue, count in per_queue.items():
            for _ in range(count):
                publish_job(job_id=uuid.uuid4(), queue=queue, app=app, redis_client=client)

        triggers = [
            trigger["metadata"]
            for doc in yaml.safe_load_all(KEDA.read_text())
            if doc and doc["kind"] == "ScaledObject"
            for trigger in doc["spec"]["triggers"]
        ]
        assert sorted(t["listName"] for t in triggers) == sorted(per_queue)
        for trigger in triggers:
            # What KEDA's redis scaler reads: LLEN <listName>.
            assert client.llen(trigger["listName"]) == per_queue[trigger["listName"]], trigger["listName"]
        # No message went to a priority-suffixed list that KEDA would not see.
        lists = {key for key in client.scan_iter() if client.type(key) == "list"}
        assert lists == set(per_queue)
    finally:
        client.close()
        app.close()
