"""Data retention limits: which ``retention_seconds`` a job gets, and which it may ask for.

Contract texts are confidential, so a tenant may ask that a job's input, output, partial text,
stream events and webhook bodies are purged some time after the job **finishes**
(``retention_seconds``, counted from ``finished_at``; the purge itself is
``scheduler/maintenance/data_purge.py``, run by ``scheduler/maintenance/retention_tick.py``).
This module is the arithmetic, pure so it is tested without a database:

- the tenant's **default** (used when a request sets none): the tenant's override, else the
  setting ``jobs.retention_default_seconds``, else none (the data lives until the result TTL);
- the tenant's **maximum** (a request above it is a 422 ``retention_too_long``, nothing stored):
  the tenant's override, else ``jobs.retention_max_seconds``, never above the result TTL
  (``jobs.result_ttl_seconds``: expiry purges the data then anyway, so a longer retention
  would be a promise nobody keeps). A default above the maximum is cut to it.

Overrides are operator state (``PATCH /v1/admin/limits`` ``{"tenants": {"acme":
{"retention_max_seconds": 86400}}}``), stored like every limit override: SQL first
(``operator_state`` rows named by :func:`override_field`), then the Redis hash ``LIMITS_KEY``. The
submit path reads them from SQL (``scheduler/fleet/retention_limits.py``), the system of record,
so a Redis restart can never loosen a maximum. A job's retention is resolved once, at submit, and
stored on its row: changing a tenant's limits later does not touch jobs already submitted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from scheduler.infra.settings import Settings

# Per-tenant fields of LIMITS_KEY / operator_state (name + ":" + tenant), seconds.
DEFAULT_FIELD = "retention_default"
MAX_FIELD = "retention_max"
RETENTION_FIELDS: tuple[str, ...] = (DEFAULT_FIELD, MAX_FIELD)


class RetentionTooLongError(ValueError):
    """A request asked to keep its data longer than its tenant may."""

    def __init__(self, requested: int, maximum: int) -> None:
        super().__init__(f"retention_seconds {requested} is above this tenant's maximum of {maximum} s")
        self.requested = requested
        self.maximum = maximum


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """A tenant's retention rule: ``default_seconds`` (None: until the result TTL) and
    ``max_seconds`` (always finite: at most the result TTL)."""

    default_seconds: int | None
    max_seconds: int

    def resolve(self, requested: int | None) -> int | None:
        """The retention a job gets: ``requested``, else the default. Raises
        ``RetentionTooLongError`` above the maximum (the API's 422)."""
        if requested is None:
            return self.default_seconds
        if requested > self.max_seconds:
            raise RetentionTooLongError(requested, self.max_seconds)
        return requested


def override_field(name: str, tenant: str) -> str:
    """The LIMITS_KEY / operator_state name of a tenant's override (``retention_max:acme``)."""
    return f"{name}:{tenant}"


def policy_for(tenant: str, overrides: Mapping[str, float], settings: Settings) -> RetentionPolicy:
    """The tenant's policy from the operator's overrides (by :func:`override_field` name; others
    are ignored) and the settings."""
    ttl = int(settings.jobs.result_ttl_seconds)
    jobs = settings.jobs
    maximum = _whole(overrides.get(override_field(MAX_FIELD, tenant)), jobs.retention_max_seconds)
    maximum = ttl if maximum is None else min(maximum, ttl)
    default = _whole(overrides.get(override_field(DEFAULT_FIELD, tenant)), jobs.retention_default_seconds)
    return RetentionPolicy(default_seconds=None if default is None else min(default, maximum),
                           max_seconds=maximum)


def deployment_policy(settings: Settings) -> RetentionPolicy:
    """The policy of a tenant without overrides (what the admin API shows as the defaults)."""
    return policy_for("", {}, settings)


def purge_due_at(finished_at: datetime, retention_seconds: int, *, settle_seconds: float) -> datetime:
    """When a finished job's data is due for purging: ``retention_seconds`` after it finished, but
    never before ``settle_seconds`` after (the worker writes its last stream events, hot status
    and webhook outbox row just after the final SQL write; a purge must come after them)."""
    return finished_at + timedelta(seconds=max(float(retention_seconds), settle_seconds))


def _whole(value: float | None, fallback: int | None) -> int | None:
    return fallback if value is None else max(0, int(value))
