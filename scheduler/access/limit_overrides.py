"""Runtime overrides of the admission limits: the Redis hash ``LIMITS_KEY`` the admin API writes
and every API process reads at once (no restart).

Which fields exist (:func:`validate_limit_field`), what is in force for each knob
(:func:`effective_limits`: Settings defaults, the overrides, the result) and the Redis write
(:func:`write_limit_overrides`). The hash mirrors SQL: the operator's change is committed there
first (``scheduler.fleet.operator_state.update_limits``) and restored from there after a Redis
restart. The admission scripts read the hash themselves (``scheduler.access.admission``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis

from scheduler.access.retention import RETENTION_FIELDS, deployment_policy
from scheduler.fairness.weights import WEIGHT_FIELD
from scheduler.infra.redis_keys import LIMITS_KEY
from scheduler.infra.settings import Settings

# Override fields accepted in LIMITS_KEY (a trailing ":" means "per <thing>": field + ":" + name).
GLOBAL_FIELDS: frozenset[str] = frozenset({"rate_per_second", "rate_burst", "tenant_max_active"})
PER_NAME_FIELDS: frozenset[str] = frozenset(
    {"rate_per_second:", "rate_burst:", "tenant_max_active:", "queue_max_depth:",
     f"{WEIGHT_FIELD}:",  # per tenant: its fair-share weight (scheduler/fairness/weights.py)
     *(f"{name}:" for name in RETENTION_FIELDS)}  # per tenant, read at submit (scheduler/access/retention.py)
)


def effective_limits(client: redis.Redis, settings: Settings) -> dict[str, Any]:
    """Defaults from Settings, overrides from Redis, and what is in force for each knob."""
    raw = client.hgetall(LIMITS_KEY)
    overrides = {_text(field): float(value) for field, value in raw.items()}
    admission = settings.admission
    queues = dict(admission.queue_max_depth)
    retention = deployment_policy(settings)  # per-tenant overrides: under "overrides"
    return {
        "defaults": {
            "retention_default_seconds": retention.default_seconds,
            "retention_max_seconds": retention.max_seconds,
            "rate_per_second": admission.rate_limit_per_second,
            "rate_burst": admission.rate_limit_burst,
            "tenant_max_active": admission.tenant_max_active_jobs,
            "queue_max_depth": queues,
        },
        "overrides": {field: _number(value) for field, value in sorted(overrides.items())},
        "effective": {
            "retention_default_seconds": retention.default_seconds,
            "retention_max_seconds": retention.max_seconds,
            "rate_per_second": _number(overrides.get("rate_per_second", admission.rate_limit_per_second)),
            "rate_burst": int(overrides.get("rate_burst", admission.rate_limit_burst)),
            "tenant_max_active": int(overrides.get("tenant_max_active", admission.tenant_max_active_jobs)),
            "queue_max_depth": {
                queue: int(overrides.get(f"queue_max_depth:{queue}", cap)) for queue, cap in queues.items()
            },
        },
    }


def validate_limit_field(field: str) -> None:
    """Raise ValueError for a field that no admission rule reads."""
    if field in GLOBAL_FIELDS:
        return
    prefix, sep, name = field.partition(":")
    if sep and f"{prefix}:" in PER_NAME_FIELDS and name:
        return
    raise ValueError(f"unknown limit {field!r}")


def write_limit_overrides(client: redis.Redis, updates: Mapping[str, float | None]) -> None:
    """Set (number) or clear (None) runtime overrides in ``LIMITS_KEY``: the Redis side only, in one
    MULTI so readers never see half. Named for what it writes, apart from the operator's
    ``operator_state.update_limits`` (SQL first, then this)."""
    for field in updates:
        validate_limit_field(field)
    pipe = client.pipeline(transaction=True)
    for field, value in updates.items():
        if value is None:
            pipe.hdel(LIMITS_KEY, field)
        else:
            pipe.hset(LIMITS_KEY, field, repr(float(value)))
    pipe.execute()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value
