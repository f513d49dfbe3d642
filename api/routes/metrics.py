"""``GET /metrics`` (Prometheus text exposition) and the request middleware that feeds it.

:func:`install_observability` is the one call ``create_app`` makes: it adds
:class:`ObservabilityMiddleware` (request id + HTTP metrics) and mounts ``/metrics``; the operator
dashboard (``api/routes/dashboard.py``) reads the same gauges. ``/metrics`` needs no key (scrapers
run inside the deployment's network; it exposes counts, never payloads or tenants).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, FastAPI, Request, Response
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy import func, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import RedisDep, SessionFactoryDep, SettingsDep
from api.tenant_queues import tenant_counts
from scheduler.fleet.workers import consuming_classes, list_workers, unconsumed_classes
from scheduler.jobs.models import Job, JobStatus, QueueName
from scheduler.observability import tracing
from scheduler.observability.cluster_metrics import render_metrics
from scheduler.observability.logging import REQUEST_ID_HEADER, accept_request_id, bind_request_id, get_logger
from scheduler.observability.process_metrics import record_http_request

log = get_logger(__name__)
router = APIRouter(tags=["observability"])

UNMATCHED_ROUTE = "unmatched"
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_REQUEST_ID_HEADER_BYTES = REQUEST_ID_HEADER.lower().encode()
_TRACE_ID_HEADER_BYTES = tracing.TRACE_ID_HEADER.lower().encode()


class ObservabilityMiddleware:
    """Pure ASGI middleware: binds a request id (echoed in ``X-Request-ID``), counts requests
    and observes latency per *route template* (``/v1/jobs/{job_id}``, never the raw path, so
    label cardinality stays bounded)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if tracing.enabled():
            await self._traced(scope, receive, send)
            return
        await self._observed(scope, receive, send)

    async def _traced(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The request inside a SERVER span continuing the client's ``traceparent`` (a new trace:
        when ``tracing.sample_root`` draws it); a recorded span's trace id is echoed in
        ``X-Trace-Id``. Only method, route template and status are recorded (never the path's ids,
        the query or the body)."""
        value = _header(scope, b"traceparent")
        parent = tracing.extract({"traceparent": value} if value else None)
        if parent is None and not tracing.sample_root():  # a new trace, sampled out: no span at all
            await self._observed(scope, receive, send)
            return
        method = scope.get("method", "GET")
        method = method if method in KNOWN_METHODS else "other"
        with tracing.start_current_span(method, context=parent, kind=SpanKind.SERVER,
                                        attributes={"http.request.method": method}) as span:
            ids = tracing.recorded_ids(span)
            status = [500]  # the status sent, kept by _observed even when the app raises after sending it
            try:
                await self._observed(scope, receive, send, trace_id=ids[0] if ids else None, status=status)
            finally:
                if ids is not None:  # a sampled-out request's span takes nothing
                    template = getattr(scope.get("route"), "path", None) or UNMATCHED_ROUTE
                    span.update_name(f"{method} {template}")
                    span.set_attributes({"http.route": template, "http.response.status_code": status[0]})
                    if status[0] >= 500:
                        span.set_status(StatusCode.ERROR)

    async def _observed(self, scope: Scope, receive: Receive, send: Send, trace_id: str | None = None,
                        status: list[int] | None = None) -> None:
        """The request, counted and timed. ``trace_id``: its recorded SERVER span's, echoed in
        ``X-Trace-Id`` and kept as the latency observation's exemplar; ``status``: set to the
        status sent (a holder, not a return value: a stream that breaks after its 200 raises)."""
        started = time.perf_counter()
        header = _header(scope, _REQUEST_ID_HEADER_BYTES)
        request_id = accept_request_id(header)
        bind_request_id(request_id)
        scope.setdefault("state", {})["request_id"] = request_id
        sent = status if status is not None else [500]
        added = [(_REQUEST_ID_HEADER_BYTES, request_id.encode())]
        if trace_id is not None:
            added.append((_TRACE_ID_HEADER_BYTES, trace_id.encode()))

        async def send_with_request_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent[0] = int(message["status"])
                message["headers"] = [*message.get("headers", []), *added]
            await send(message)

        try:
            await self.app(scope, receive, send_with_request_id)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or UNMATCHED_ROUTE
            method = scope.get("method", "GET")
            record_http_request(
                route=template,
                method=method if method in KNOWN_METHODS else "other",  # clients choose methods
                status=sent[0],
                seconds=time.perf_counter() - started,
                trace_id=trace_id,
            )


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def queue_depths(session_factory: Any) -> dict[str, int]:
    """Jobs waiting per queue, from SQL (the system of record; Redis may have been flushed)."""
    depths = {queue.value: 0 for queue in QueueName}
    with session_factory() as session:
        rows = session.execute(
            select(Job.queue, func.count()).where(Job.status == JobStatus.QUEUED.value).group_by(Job.queue)
        ).all()
    for queue, n in rows:
        depths[str(queue)] = int(n)
    return depths


def tenant_queues(session_factory: Any) -> dict[tuple[str, str], tuple[int, float]]:
    """Per ``(queue, tenant)``: jobs queued and how long the oldest due one has waited (SQL;
    ``api/tenant_queues.py``)."""
    with session_factory() as session:
        counts = tenant_counts(session)
    return {key: (int(figures["queued"]), float(figures["oldest_wait_seconds"]))
            for key, figures in counts.items() if figures["queued"]}


def workers_ready(redis_client: Any) -> Mapping[str, int]:
    """Ready workers per queue whose Celery consumer consumes it now (from the worker registry:
    each consumer read back by its worker; every known queue listed, 0 when none)."""
    ready = {queue.value: 0 for queue in QueueName}
    for worker in list_workers(redis_client):  # a handful of workers
        if worker.is_ready:
            for queue in consuming_classes(worker):
                ready[queue] = ready.get(queue, 0) + 1
    return ready


def workers_unconsumed(redis_client: Any) -> Mapping[str, int]:
    """Per queue, the ready workers that should consume it (by their own state) and do not."""
    missing = {queue.value: 0 for queue in QueueName}
    for worker in list_workers(redis_client):
        if worker.is_ready:
            for queue in unconsumed_classes(worker):
                missing[queue] = missing.get(queue, 0) + 1
    return missing


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request, settings: SettingsDep, redis_client: RedisDep,
                  session_factory: SessionFactoryDep) -> Response:
    """Prometheus exposition: this process's HTTP/submit families + cluster-wide job and worker
    families read from Redis + queue depth from SQL (computed now, in a worker thread)."""
    body, content_type = await anyio.to_thread.run_sync(
        lambda: render_metrics(
            redis_client,
            queue_depths=lambda: queue_depths(session_factory),
            workers_ready=lambda: workers_ready(redis_client),
            workers_unconsumed=lambda: workers_unconsumed(redis_client),
            tenant_queues=lambda: tenant_queues(session_factory),
            multiproc_dir=settings.observability.prometheus_multiproc_dir,
            openmetrics="application/openmetrics-text" in request.headers.get("accept", ""),
        )
    )
    return Response(content=body, media_type=content_type)


def install_observability(app: FastAPI) -> None:
    """Add the request-id/metrics middleware and mount ``/metrics`` (``create_app`` mounts the
    dashboard, which builds on this module's helpers)."""
    app.add_middleware(ObservabilityMiddleware)
    app.include_router(router)
