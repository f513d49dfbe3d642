"""The FastAPI application factory.

``create_app(settings)`` wires the process-wide resources (database engine, Redis client,
prompt token counter) onto ``app.state`` once, installs the error shape and the body-size
limit, and mounts one router per resource. ``cloverq api`` serves it with uvicorn
(``uvicorn --factory api.app:create_app``).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
import structlog
from fastapi import FastAPI

from api.auth import install_security, meter_refused_request
from api.body_limit import BodyLimitMiddleware
from api.drain import ApiDrain, register, unregister
from api.errors import install_error_handlers
from api.job_follow import close_stream_redis, waiter_redis
from api.job_waiter import JobWaiter
from api.planes import PlaneGuard
from api.prompt_tokens import PromptTokenCounter
from api.routes import (
    admin,
    admin_canary,
    admin_models,
    batches,
    dashboard,
    data_purge,
    health,
    job_events,
    jobs,
    openai,
    openai_batches,
    webhooks,
)
from api.routes.metrics import install_observability
from scheduler.fleet.operator_state import restore_quietly
from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.db import DatabaseTimeouts, make_engine, session_factory
from scheduler.infra.gc_freeze import freeze_startup_heap, thaw_heap
from scheduler.infra.redis_client import get_redis
from scheduler.infra.settings import Settings, get_settings
from scheduler.observability.tracing import setup_tracing

# Sync routes and dependencies run in anyio's thread pool; its default of 40 threads would
# queue requests behind each other at high concurrency while they wait on the database.
API_THREADS = 128
OPERATOR_STATE_RESTORE_SECONDS = 2.0  # at start-up, then the API serves regardless
SHUTDOWN_STEP_SECONDS = 5.0  # each asynchronous clean-up step at shutdown

log = structlog.get_logger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the API for ``settings`` (default: the process settings from the environment)."""
    settings = settings or get_settings()
    setup_tracing(settings, process="api")  # off by default: creates nothing
    engine = make_engine(settings.resolved_database_url, timeouts=DatabaseTimeouts.from_settings(settings))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = API_THREADS
        # The checkpoint's tokenizer and context (config.json): prompts are counted and judged by them.
        app.state.token_counter = await anyio.to_thread.run_sync(
            lambda: PromptTokenCounter.from_model_dir(settings.resolved_model_dir, dtype=settings.model.dtype)
        )
        # Redis may have restarted empty since the last API start: put the drains and limits
        # recorded in SQL back before the first request is admitted (scheduler/fleet/operator_state.py).
        # Bounded: a silent database must not keep the API (and its fast /readyz 503) from
        # starting; an abandoned restore finishes in the background and beat's tick retries.
        with anyio.move_on_after(OPERATOR_STATE_RESTORE_SECONDS):
            await anyio.to_thread.run_sync(_restore_operator_state, app, abandon_on_cancel=True)
        freeze_startup_heap()  # short full GCs from here on (scheduler/infra/gc_freeze.py)
        app.state.job_waiter.start()  # subscribed before the first long poll arrives
        # SIGTERM drains this app first (api/drain.py): its long polls wake to re-read their deadline.
        app.state.drain.bind(asyncio.get_running_loop(), app.state.job_waiter.wake_all)
        register(app.state.drain)
        try:
            yield
        finally:
            unregister(app.state.drain)
            thaw_heap()
            # Bounded: a Redis connection that never answers must not hold the API's shutdown
            # (a TestClient teardown once waited 300 s here); what is left is dropped with the process.
            with anyio.move_on_after(SHUTDOWN_STEP_SECONDS) as waiter_scope:
                await app.state.job_waiter.close()
            with anyio.move_on_after(SHUTDOWN_STEP_SECONDS) as stream_scope:
                await close_stream_redis(app)
            # The keys' last uses noted since the last flush (scheduler/access/api_keys.py).
            with anyio.move_on_after(SHUTDOWN_STEP_SECONDS) as keys_scope:
                await anyio.to_thread.run_sync(app.state.security.authenticator.close, abandon_on_cancel=True)
            if waiter_scope.cancelled_caught or stream_scope.cancelled_caught or keys_scope.cancelled_caught:
                log.warning("api.shutdown_step_abandoned", seconds=SHUTDOWN_STEP_SECONDS)
            # app.state.redis stays open: it is the process' shared client (scheduler/infra/redis_client.py).
            engine.dispose()

    app = FastAPI(
        title="cloverq",
        summary="Asynchronous jobs on MoE block-diffusion language models.",
        version="0.1.0",
        lifespan=lifespan,
        **_fastapi_telemetry_off(),
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = session_factory(engine)
    # The process' one sync client for the URL (one pool; short timeouts, so a hanging Redis fails
    # a request fast): the routes, auth's rate limit and admission, the admin routes all use it.
    app.state.redis = get_redis(settings.resolved_redis_url)
    app.state.celery = create_celery_app(settings)
    # GET /v1/jobs/{id}?wait=S; its subscription has its own small asyncio pool (api/job_follow.py).
    app.state.job_waiter = JobWaiter(lambda: waiter_redis(app))
    app.state.drain = ApiDrain(settings.planes.drain_seconds)  # begun by SIGTERM (api/graceful_stop.py)
    install_security(app, settings, session_factory=app.state.session_factory, redis_client=app.state.redis)
    # Batch bodies parsed at once (each costs a few times its size while it is parsed).
    app.state.batch_uploads = anyio.Semaphore(settings.batches.max_concurrent_uploads)
    # Replaced at start-up by the lifespan; the byte bound is the safe default meanwhile.
    app.state.token_counter = PromptTokenCounter(None)

    install_error_handlers(app, meter_refused=meter_refused_request)
    uploads = ("/v1/batches", *openai_batches.FILE_PATHS)  # batch bodies and OpenAI batch files
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.limits.max_body_bytes,
                       path_limits=dict.fromkeys(uploads, settings.batches.max_body_bytes))
    # Each request on its plane's listener and inside the plane's allow-list (api/planes.py).
    app.add_middleware(PlaneGuard, planes=settings.planes)
    install_observability(app)  # outermost middleware: request id + HTTP metrics for every answer
    app.include_router(dashboard.router)  # the operator dashboard (it reads /metrics' gauges)
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(job_events.router)  # GET /v1/jobs/{id}/events (SSE)
    app.include_router(batches.router)
    app.include_router(data_purge.router)  # DELETE /v1/jobs/{id}/data, /v1/batches/{id}/data
    # OpenAI-compatible: /v1/{chat/completions,completions,models,files} and all of it, the Batch
    # API included, under /openai/v1 (cloverq's own /v1/batches stays as it is).
    app.include_router(openai.router)
    app.include_router(openai.openai_router)
    app.include_router(openai_batches.files_router)
    app.include_router(openai_batches.openai_files_router)
    app.include_router(openai_batches.batches_router)
    app.include_router(webhooks.router)
    app.include_router(admin.router)
    app.include_router(admin_models.router)
    app.include_router(admin_canary.router)
    return app


def _restore_operator_state(app: FastAPI) -> None:
    """Mirror the operator state of SQL into Redis; a failure is logged, never fatal (beat's
    reconcile tick retries it)."""
    with app.state.session_factory() as session:
        restore_quietly(session, app.state.redis, where="api_start")


def _fastapi_telemetry_off() -> dict[str, Any]:
    """FastAPI's own OpenTelemetry (newer releases: ``FastAPI(telemetry=...)``) switched off.

    It traces every request, dependency and serialization as soon as any global tracer provider
    exists (ours, when tracing is on), records paths, queries and validation errors (which quote
    the input), and with ``FASTAPI_OTEL_AUTO_CONFIGURE`` builds exporters of its own even with
    cloverq's tracing off. The API's spans are cloverq's (``api/routes/metrics.py``): one server
    span per request, ids and counts only. Older FastAPI releases have no such parameter.
    """
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False,
                          "auto_configure": False}}
