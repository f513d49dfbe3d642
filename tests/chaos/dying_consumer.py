"""A consumer that takes a job's message from Redis and dies before claiming it (chaos tests).

``python -m tests.chaos.dying_consumer QUEUE`` (settings from ``CLOVERQ_*``): stores a tiny job,
publishes its message to ``QUEUE`` the way the API does (enqueued marker first), prints the job
id, takes the message with a real kombu consumer WITHOUT acknowledging it (kombu moves it to its
unacked set, as it does for every delivery to a worker), then SIGKILLs itself: the state a worker
leaves behind when it is killed between receiving a message and committing its claim.
"""

from __future__ import annotations

import os
import signal
import sys

from kombu import Queue

from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.db import get_session_factory
from scheduler.infra.redis_client import get_redis
from scheduler.infra.settings import get_settings
from scheduler.jobs.enqueue import publish_job
from scheduler.jobs.service import submit_job


def main() -> None:
    queue = sys.argv[1]
    settings = get_settings()
    app = create_celery_app(settings)
    with get_session_factory(settings.resolved_database_url)() as session:
        job, _ = submit_job(session, tenant="default", kind="generate", input={"prompt": "orphan"},
                            params={"max_new_tokens": 4, "steps_per_block": 1}, settings=settings,
                            publish=False)
    publish_job(job_id=job.id, queue=queue, app=app, redis_client=get_redis(settings.resolved_redis_url))
    print(f"job {job.id}", flush=True)
    with app.connection_for_read() as connection:
        message = Queue(queue, routing_key=queue)(connection.default_channel).get(no_ack=False)
        if message is None:
            sys.exit("no message delivered")
        print(f"holding delivery {message.delivery_tag}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
