"""Publishing a job's Celery message (id only) and recording that it exists.

The ``enqueued`` marker key is what the reconciler checks: a queued row without it has no
message in Redis (publish failed, Redis flushed, retry due) and is published again. A
duplicate message is harmless: the fenced claim lets only one delivery run the job.
"""

from __future__ import annotations

import uuid
from contextlib import AbstractContextManager, nullcontext

import redis
import structlog
from celery import Celery
from opentelemetry.trace import SpanKind

from scheduler.infra import redis_keys
from scheduler.infra.broker import admitted_headers, releases_reservations
from scheduler.infra.celery_app import RUN_JOB_TASK
from scheduler.observability import tracing

log = structlog.get_logger(__name__)

# Publishing must fail fast (the row stays queued; the reconciler publishes later). kombu's
# retry (``Connection.ensure``) is kept although it costs ~40 us per message even when nothing
# fails: it also revives a pooled producer's channel after a broker restart. A retry of our own
# with ``retry=False`` was tried; with it one chaos run (Redis restarted mid-run) stalled with
# messages left unconsumed, cause not pinned down, so the proven path is back.
PUBLISH_RETRY_POLICY = {"max_retries": 1, "interval_start": 0.0, "interval_step": 0.2, "interval_max": 0.2}


def publish_job(
    *, job_id: uuid.UUID | str, queue: str, app: Celery, redis_client: redis.Redis,
    request_id: str | None = None, marker_set: bool = False, tenant: str | None = None,
    lane: str | None = None, trace_ids: tuple[str | None, str | None] | None = None,
) -> None:
    """Set the job's enqueued marker, then send ``cloverq.run_job(job_id)`` to ``queue``.

    ``lane``: the Celery queue that carries the message when it is not ``queue`` itself (a
    canary job's ``canary.<queue>``, ``scheduler.model_versions.canary_routing``); the marker then holds the
    lane, so the reconciler can tell a message left on a lane a transition retired.

    The marker is set FIRST: a worker may run (and fail, and clear the marker of) the job
    before ``send_task`` even returns; a marker written after that would hide the retry from
    the reconciler. If sending fails the marker is removed again. ``marker_set``: the caller
    already set it (the API's admission script does, in its own round trip, together with the
    job's reservations for ``queue`` and ``tenant``, which the message then releases: see
    ``scheduler.infra.broker``; on a failed send they are released here).

    Tracing: the message carries the ``traceparent`` of the submit's request span, the worker's
    parent (the publish is an event of it; a ``cloverq.publish`` span with ``tracing_step_spans``).
    ``trace_ids``: the job's stored ``(trace_id, trace_span_id)`` when the caller is not inside the
    job's submit (the reconciler republishing, aging, fair share releasing): a ``cloverq.republish``
    span joins that trace, and a job without one gets none and no ``traceparent`` (default None: the
    current span's).
    """
    headers: dict[str, object] = {"cloverq_request_id": request_id} if request_id else {}
    admitted = marker_set and tenant is not None
    if admitted:
        assert tenant is not None
        headers.update(admitted_headers(queue=queue, tenant=tenant, job_id=job_id))
    marker = redis_keys.enqueued(job_id)
    target = lane or queue
    if not marker_set or target != queue:
        redis_client.set(marker, target, ex=redis_keys.ENQUEUED_TTL_SECONDS)
    with _publish_span(job_id, target, trace_ids):
        tracing.inject(headers)
        _send(job_id=job_id, queue=queue, target=target, app=app, redis_client=redis_client, headers=headers,
              marker=marker, admitted=admitted, tenant=tenant)
    if admitted and not releases_reservations(app):  # another transport: release it ourselves
        with redis_client.pipeline(transaction=False) as pipe:
            _release_reservations(pipe, queue=queue, tenant=tenant, job_id=job_id)
            pipe.execute()


def _publish_span(job_id: uuid.UUID | str, target: str,
                  trace_ids: tuple[str | None, str | None] | None) -> AbstractContextManager[object]:
    if trace_ids is None:  # a submit: a step of its request's span, when that is recorded
        if not tracing.recording():
            return nullcontext()
        return tracing.step("cloverq.publish", kind=SpanKind.PRODUCER,
                            attributes=tracing.job_attributes(job_id=job_id, queue=target))
    if not tracing.enabled():
        return nullcontext()
    return tracing.job_span("cloverq.republish", tracing.stored_parent(*trace_ids), kind=SpanKind.PRODUCER,
                            **tracing.job_attributes(job_id=job_id, queue=target))


def _send(*, job_id: uuid.UUID | str, queue: str, target: str, app: Celery, redis_client: redis.Redis,
          headers: dict[str, object], marker: str, admitted: bool, tenant: str | None) -> None:
    """Send the message; on failure drop the marker (and release the reservations) again."""
    try:
        # declare=[]: the queue's list needs no declaring on Redis (a message to the default
        # exchange goes straight to the list named by its routing key), and Celery's
        # per-publish maybe_declare costs ~30 us.
        app.send_task(RUN_JOB_TASK, args=[str(job_id)], queue=target, routing_key=target, retry=True,
                      retry_policy=PUBLISH_RETRY_POLICY, declare=[], headers=headers or None)
    except Exception:
        with redis_client.pipeline(transaction=False) as pipe:
            pipe.delete(marker)
            if admitted:
                _release_reservations(pipe, queue=queue, tenant=tenant, job_id=job_id)
            pipe.execute()
        raise


def _release_reservations(pipe: redis.client.Pipeline, *, queue: str, tenant: str | None,
                          job_id: uuid.UUID | str) -> None:
    member = redis_keys.enqueued(job_id)
    pipe.zrem(redis_keys.queue_reservations(queue), member)
    pipe.zrem(redis_keys.tenant_reservations(str(tenant)), member)


def try_publish_job(
    *, job_id: uuid.UUID | str, queue: str, app: Celery, redis_client: redis.Redis,
    request_id: str | None = None, marker_set: bool = False, tenant: str | None = None,
    lane: str | None = None, trace_ids: tuple[str | None, str | None] | None = None,
) -> bool:
    """``publish_job``, but a broker failure is logged and left to the reconciler."""
    try:
        publish_job(job_id=job_id, queue=queue, app=app, redis_client=redis_client, request_id=request_id,
                    marker_set=marker_set, tenant=tenant, lane=lane, trace_ids=trace_ids)
    except Exception as exc:  # any broker/transport error: the row is durable, recovery is periodic
        log.warning("job.publish_failed", job_id=str(job_id), queue=queue, error=repr(exc))
        return False
    return True
