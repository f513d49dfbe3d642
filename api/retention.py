"""A submit's data retention: the request's ``retention_seconds`` against its tenant's policy.

Runs in the submit's session before admission, so a refusal (422 ``retention_too_long``) stores
nothing and reserves nothing. The policy (default and maximum) is the tenant's override in SQL,
else the settings (``scheduler/access/retention.py``, ``scheduler/fleet/retention_limits.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from sqlalchemy.orm import Session

from api.errors import ApiError
from scheduler.access.retention import RetentionPolicy, RetentionTooLongError
from scheduler.batches.service import JobSpec
from scheduler.fleet.retention_limits import tenant_retention_policy
from scheduler.infra.settings import Settings


def too_long(exc: RetentionTooLongError, loc: Sequence[Any]) -> ApiError:
    """The 422 of a retention above the tenant's maximum (``loc``: where the field was)."""
    message = f"{exc}; ask for at most {exc.maximum} seconds"
    return ApiError(422, "retention_too_long", message,
                    [{"loc": list(loc), "message": message, "retention_seconds": exc.requested,
                      "max_retention_seconds": exc.maximum}])


def job_retention(session: Session, *, tenant: str, requested: int | None, settings: Settings) -> int | None:
    """The retention a job of ``tenant`` gets (the request's, else the tenant's default)."""
    policy = tenant_retention_policy(session, tenant=tenant, settings=settings)
    try:
        return policy.resolve(requested)
    except RetentionTooLongError as exc:
        raise too_long(exc, ["body", "retention_seconds"]) from None


def batch_retention(session: Session, *, tenant: str, specs: Sequence[JobSpec], requested: int | None,
                    settings: Settings) -> tuple[int | None, list[JobSpec]]:
    """``(the batch's retention, its specs with theirs)``: a spec's own ``retention_seconds``
    wins over the batch's, which wins over the tenant's default. 422 naming the first one too long."""
    policy = tenant_retention_policy(session, tenant=tenant, settings=settings)
    batch_default = _resolve(policy, requested, ["body", "retention_seconds"])
    resolved = []
    for index, spec in enumerate(specs):
        own, loc = spec.retention_seconds, ["body", "jobs", index, "retention_seconds"]
        value = batch_default if own is None else _resolve(policy, own, loc)
        resolved.append(dataclasses.replace(spec, retention_seconds=value))
    return batch_default, resolved


def _resolve(policy: RetentionPolicy, requested: int | None, loc: list[Any]) -> int | None:
    try:
        return policy.resolve(requested)
    except RetentionTooLongError as exc:
        raise too_long(exc, loc) from None
