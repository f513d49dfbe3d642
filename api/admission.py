"""Admission of a new job at the API: queue-depth and tenant caps -> 429 before anything is stored.

The two rules that depend on the request itself (``scheduler.access.admission``): the queue the job
would be routed to must not be full, and the tenant must be under its cap of queued + running
jobs; both are checked and reserved in one atomic step, so concurrent submits never pass a cap.
The route is computed with the same pure function ``scheduler.jobs.service.submit_job`` uses (a batch:
``scheduler.batches.service.batch_route``, as ``create_batch`` stores it), so the checked queue is the
queue the job will go to. An idempotent repeat (same tenant +
``Idempotency-Key`` already stored) stores nothing new, so these rules never refuse it.

The per-key rate limit runs in the route's caller dependency (``api.auth.requires``) for most
routes; the submit hot path (``POST /v1/jobs``, the OpenAI completions) authenticates with
``api.deps.AdmittedSubmitCaller`` (``requires(Scope.SUBMIT, token_at_admission=True)``), and
its token is taken here when the route passes ``metered=False`` (``api.auth.token_taken`` says
no token was taken yet): inside the admission script when there is one to run, else on its
own (``api.auth.meter_caller``). If the route never reaches this call, the dependency takes
the token itself, so every submit, refused or repeated, spends exactly one.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import redis
import structlog
from fastapi import Request
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.auth import Caller, enforce_rate, meter_caller, security_of
from api.errors import ApiError
from api.limit_messages import admission_refused
from scheduler.access.admission import AdmissionRefused, count_active_jobs
from scheduler.batches.service import batch_route
from scheduler.infra import redis_keys
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job
from scheduler.jobs.routing import InvalidPriorityError, route_job

log = structlog.get_logger(__name__)


def admit_submission(
    request: Request,
    session: Session,
    caller: Caller,
    *,
    settings: Settings,
    kind: str,
    input: Mapping[str, Any] | None,
    params: Mapping[str, Any],
    priority: str | None,
    idempotency_key: str | None = None,
    enqueued_marker: str | None = None,
    metered: bool = True,
    prompt_tokens: int = 0,
) -> bool:
    """Raise a 429 ``ApiError`` (``queue_full`` / ``tenant_limit``) if the job must be refused.

    ``enqueued_marker``: the new job's enqueued-marker key, set in the admission round trip
    when the job is admitted (see ``Admission.check_batch``); returns whether it was set.
    ``metered=False``: the caller came through ``AdmittedSubmitCaller`` and its rate-limit
    token is not taken yet (``token_taken(request)`` is False), so it is taken here too, in the
    same Redis round trip (401 revoked / 429 rate_limited). ``prompt_tokens``: the input's tokens
    as counted at validation (the route's cost counts them, as ``submit_job``'s does).
    """
    repeat = idempotency_key is not None and _exists(session, tenant=caller.tenant, key=idempotency_key)
    route = None
    if not repeat:
        try:
            route = route_job(kind=kind, input=input, params=params, priority=priority, settings=settings,
                              prompt_tokens=prompt_tokens)
        except InvalidPriorityError:
            route = None  # submit_job reports the bad priority with its own 4xx
    # The rate limit rides in the admission script when there is one to run for a keyed caller.
    combined = not metered and route is not None and caller.key_id is not None and enqueued_marker is not None
    if not metered and not combined:
        meter_caller(request, caller)
    if route is None:  # a repeat stores nothing new, so it is never refused here
        return False
    if not combined:
        member = enqueued_marker or redis_keys.enqueued(uuid.uuid4())  # without a marker: expires
        return _admit(request, session, caller, jobs={route.queue.value: [member]},
                      enqueued_marker=enqueued_marker)
    assert caller.key_id is not None and enqueued_marker is not None
    try:  # the rate limit and the queue rule in one Redis round trip
        decision, marked = security_of(request).admission.admit_job(
            bucket=caller.key_id, key_id=caller.key_id, tenant=caller.tenant, queue=route.queue.value,
            enqueued_marker=enqueued_marker,
            active_jobs=lambda: count_active_jobs(session, tenant=caller.tenant),
        )
    except AdmissionRefused as refused:
        raise _refusal(caller, refused, [route.queue.value]) from None
    except redis.RedisError as exc:
        log.warning("admission.unavailable", error=type(exc).__name__)  # fail open, see _admit
        return False
    enforce_rate(request, caller, decision)
    return marked


def admit_batch(
    request: Request, session: Session, caller: Caller, *, settings: Settings, specs: Sequence[Any]
) -> list[uuid.UUID]:
    """Like :func:`admit_submission` for a whole batch (all or nothing): every job counts
    against the cap of the queue it will be stored in (``bulk``, or ``joint`` for joint-mode
    decisions: ``scheduler.batches.service.batch_route``) and the tenant's cap. ``specs`` are
    ``scheduler.batches.service.JobSpec``. Returns the jobs' ids, one per spec, for ``create_batch``:
    the jobs are reserved under them until ``publish_batch(..., tenant=)`` sends their messages."""
    job_ids = [uuid.uuid4() for _ in specs]
    jobs: dict[str, list[str]] = defaultdict(list)
    for spec, job_id in zip(specs, job_ids, strict=True):
        try:
            route = batch_route(spec, settings)
        except InvalidPriorityError:
            continue  # reported by the batch's own validation
        jobs[route.queue.value].append(redis_keys.enqueued(job_id))
    if jobs:
        _admit(request, session, caller, jobs=dict(jobs))
    return job_ids


def _admit(request: Request, session: Session, caller: Caller, *, jobs: dict[str, list[str]],
           enqueued_marker: str | None = None) -> bool:
    admission = security_of(request).admission
    try:
        return admission.check_batch(
            tenant=caller.tenant,
            jobs=jobs,
            enqueued_marker=enqueued_marker,
            active_jobs=lambda: count_active_jobs(session, tenant=caller.tenant),  # SQL only when needed
        )
    except AdmissionRefused as refused:
        raise _refusal(caller, refused, sorted(jobs)) from None
    except redis.RedisError as exc:
        # Fail open like the rate limit: publishing will fail the same way and the row stays
        # queued for the reconciler, which is the documented behaviour without Redis.
        log.warning("admission.unavailable", error=type(exc).__name__)
        return False


def _refusal(caller: Caller, refused: AdmissionRefused, queues: list[str]) -> ApiError:
    log.info("admission.refused", code=refused.code, tenant=caller.tenant, key_id=caller.key_id,
             queues=queues)
    return admission_refused(refused)  # the cap's setting and what to do, with Retry-After


def _exists(session: Session, *, tenant: str, key: str) -> bool:
    query = select(Job.id).where(Job.tenant == tenant, Job.idempotency_key == key)
    return session.scalar(query) is not None
