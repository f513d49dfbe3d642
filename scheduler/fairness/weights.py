"""Per-tenant fair-share weights: operator overrides kept like every other limit override.

A tenant's weight is its share of a class while several tenants wait (default 1: equal). It is a
runtime limit override like a tenant's job cap: the field ``fair_weight:<tenant>`` of the Redis
hash ``LIMITS_KEY``, written by ``scheduler.fleet.operator_state.update_limits`` (SQL first, the
``operator_state`` table, then Redis; restored from SQL after a Redis restart), so no migration
and no second mechanism. Set through ``PUT /v1/admin/tenants/{tenant}/weight``, ``PATCH
/v1/admin/limits`` (``tenants.<t>.weight``) or ``cloverq tenants weight``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import redis

from scheduler.infra.redis_keys import LIMITS_KEY

WEIGHT_FIELD = "fair_weight"  # LIMITS_KEY field prefix: "fair_weight:<tenant>"
DEFAULT_WEIGHT = 1.0
MIN_WEIGHT = 0.01  # a weight is a share, never a block: 0 would starve the tenant
MAX_WEIGHT = 1000.0


def weight_field(tenant: str) -> str:
    return f"{WEIGHT_FIELD}:{tenant}"


def parse_weights(limits: Mapping[bytes | str, bytes | str]) -> dict[str, float]:
    """The weights among ``LIMITS_KEY``'s fields (others, and garbled values, ignored)."""
    prefix = f"{WEIGHT_FIELD}:"
    weights: dict[str, float] = {}
    for raw_field, raw_value in limits.items():
        name = raw_field.decode() if isinstance(raw_field, bytes) else raw_field
        if not name.startswith(prefix):
            continue
        try:
            value = float(raw_value.decode() if isinstance(raw_value, bytes) else raw_value)
        except ValueError:
            continue
        if value > 0:
            weights[name[len(prefix):]] = min(MAX_WEIGHT, max(MIN_WEIGHT, value))
    return weights


def read_weights(client: redis.Redis) -> dict[str, float]:
    """Every tenant's weight override (one HGETALL of the small limits hash)."""
    return parse_weights(client.hgetall(LIMITS_KEY))


def weight_of(weights: Mapping[str, float]) -> Callable[[str], float]:
    """A tenant -> weight function over ``weights``, defaulting to :data:`DEFAULT_WEIGHT`."""
    return lambda tenant: weights.get(tenant, DEFAULT_WEIGHT)
