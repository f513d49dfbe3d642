"""The Celery application: Redis broker, one queue per priority class, at-least-once delivery.

Messages carry only a job id; SQL is the system of record. Delivery settings follow
docs/architecture.md §3.3: ``acks_late`` + ``reject_on_worker_lost`` + prefetch 1, and a Redis
``visibility_timeout`` above the longest job deadline so a running job is never redelivered
while it legitimately runs. Queues are consumed in strict priority order
(``queue_order_strategy="priority"``: BRPOP lists the worker's queues in the order given), so
``interactive`` is always drained before ``standard`` and ``bulk``; aging prevents starvation.
"""

from __future__ import annotations

from functools import lru_cache

from celery import Celery
from kombu import Queue

from scheduler.infra.beat_schedule import beat_schedule
from scheduler.infra.broker import TRANSPORT_PATH
from scheduler.infra.broker_sentinel import SENTINEL_TRANSPORT_PATH
from scheduler.infra.queue_names import ALL_QUEUES, QueueName
from scheduler.infra.redis_client import redis_ssl_options
from scheduler.infra.redis_sentinel import is_sentinel_url, kombu_broker
from scheduler.infra.settings import Settings, get_settings

RUN_JOB_TASK = "cloverq.run_job"


def create_celery_app(settings: Settings) -> Celery:
    """A Celery app configured for ``settings`` (tasks register via ``shared_task`` on import)."""
    url = settings.resolved_redis_url
    sentinel_options: dict[str, object] = {}
    broker = url
    if is_sentinel_url(url):  # kombu's Sentinel form: sentinel://...;sentinel://... + master_name
        broker, sentinel_options = kombu_broker(url)
    app = Celery("cloverq", broker=broker, set_as_current=False)
    tls = redis_ssl_options(url)
    if tls is not None:
        # rediss://: the URL's TLS options, verification on by default, for the broker and any
        # Redis result backend (kombu alone would connect to a rediss:// server unverified).
        app.conf.broker_use_ssl = tls
        app.conf.redis_backend_use_ssl = tls
    if url.startswith(("redis://", "rediss://")):  # unix sockets keep kombu's stock transport
        app.conf.broker_transport = TRANSPORT_PATH
    elif sentinel_options:
        app.conf.broker_transport = SENTINEL_TRANSPORT_PATH
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=QueueName.STANDARD.value,
        task_queues=[Queue(name, routing_key=name) for name in ALL_QUEUES],
        task_create_missing_queues=True,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": int(settings.broker_visibility_timeout_seconds),
            "queue_order_strategy": "priority",
            **sentinel_options,
        },
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
        enable_utc=True,
        imports=("scheduler.maintenance.tasks", "scheduler.maintenance.delayed", "scheduler.fairness.tasks",
                 "scheduler.webhooks.tasks"),
    )
    app.conf.beat_schedule = beat_schedule(settings)
    return app


@lru_cache(maxsize=1)
def get_celery_app() -> Celery:
    """The process-wide app built from ``get_settings()``."""
    return create_celery_app(get_settings())
