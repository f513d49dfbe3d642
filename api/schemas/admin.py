"""Request and response models of the admin API (``/v1/admin``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, StringConstraints

from api.schemas.common import MAX_RETENTION_SECONDS, StrictModel, storable_text
from scheduler.access.api_keys import MAX_ALLOWED_NETWORKS, MAX_ROTATION_OVERLAP_SECONDS
from scheduler.access.networks import normalised_networks
from scheduler.fairness.weights import DEFAULT_WEIGHT, MAX_WEIGHT, MIN_WEIGHT
from scheduler.jobs.models import QueueName

TenantName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")]
KeyId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{12}$")]
# scheduler.access.api_keys.ALL_SCOPES, as a type (tests/unit/test_security_keys.py holds them equal)
Scope = Literal["submit", "read", "webhooks", "admin"]
_DEFAULT_SCOPES: tuple[Scope, ...] = ("read", "submit")
KeyLabel = Annotated[str, StringConstraints(max_length=200), AfterValidator(storable_text)]


def _canonical_networks(value: list[str]) -> list[str]:
    """CIDRs in canonical form, de-duplicated (a ValueError becomes the 422)."""
    return list(dict.fromkeys(normalised_networks(value)))


Networks = Annotated[
    list[Annotated[str, StringConstraints(min_length=1, max_length=64)]],
    Field(max_length=MAX_ALLOWED_NETWORKS, description="CIDR networks the key may be used from "
          "(e.g. 10.0.0.0/8, 2001:db8::/32, 127.0.0.2/32); empty or null: any address."),
    AfterValidator(_canonical_networks),
]


class WorkerOut(BaseModel):
    """One live worker process, from the worker registry in Redis."""

    id: str
    hostname: str
    pid: int
    queues: list[str] = Field(description="Queues the worker is configured for.")
    state: str = Field(description="starting, ready, switching (model version), draining, failed or stopped.")
    model_version: str | None = None
    model_switch_error: str | None = Field(
        None, description="Why its last switch to the active model version failed (it kept the old one)."
    )
    started_at: float = Field(description="Unix time the process started.")
    heartbeat_at: float = Field(description="Unix time of its last heartbeat.")


class WorkerList(BaseModel):
    items: list[WorkerOut]
    drained_queues: list[str]
    ready_per_queue: dict[str, int] = Field(
        default_factory=dict, description="Ready workers (loaded, warmed up, taking jobs) per queue."
    )


class QueueOut(BaseModel):
    name: str
    depth: int = Field(description="Messages waiting in the broker.")
    max_depth: int = Field(description="Submits routed here are refused (429) at this depth.")
    drained: bool = Field(description="Workers do not consume a drained queue.")


class QueueList(BaseModel):
    items: list[QueueOut]


class QueueAction(BaseModel):
    queue: str
    drained: bool
    nodes: list[str] = Field(description="Worker nodes that acknowledged the change.")


class LimitValues(BaseModel):
    rate_per_second: float = Field(description="Per-key requests per second (0 = unlimited).")
    rate_burst: int
    tenant_max_active: int = Field(description="Queued + running jobs per tenant.")
    queue_max_depth: dict[str, int]
    retention_default_seconds: int | None = Field(
        None, description="Retention of a job that sets none (null: until the result TTL); per tenant: "
        "overrides retention_default:<tenant>.")
    retention_max_seconds: int | None = Field(
        None, description="Longest retention_seconds a job may ask for (at most the result TTL); per "
        "tenant: overrides retention_max:<tenant>.")


class LimitsOut(BaseModel):
    defaults: LimitValues = Field(description="From Settings (environment).")
    effective: LimitValues = Field(description="What global rules use now.")
    overrides: dict[str, float] = Field(description="Runtime overrides in Redis, per field.")


class KeyRateLimit(StrictModel):
    rate_per_second: float | None = Field(None, ge=0, le=1_000_000)
    rate_burst: int | None = Field(None, ge=1, le=10_000_000)


class TenantLimit(StrictModel):
    max_active: int | None = Field(None, ge=1, le=1_000_000_000)
    retention_default_seconds: int | None = Field(
        None, ge=0, le=MAX_RETENTION_SECONDS, description="Retention of the tenant's jobs that set none.")
    retention_max_seconds: int | None = Field(
        None, ge=0, le=MAX_RETENTION_SECONDS, description="Longest retention_seconds its jobs may ask for.")
    weight: float | None = Field(
        None, ge=MIN_WEIGHT, le=MAX_WEIGHT, description="Fair-share weight inside each class (default 1): "
        "while several tenants wait, each gets capacity in proportion to it (scheduler/fairness/).")


class TenantWeight(StrictModel):
    """A tenant's fair-share weight; null drops the override (back to 1)."""

    weight: float | None = Field(..., ge=MIN_WEIGHT, le=MAX_WEIGHT)


class TenantWeightOut(BaseModel):
    tenant: str
    weight: float = Field(description="The weight in force (the override, else the default).")
    overridden: bool
    default: float = DEFAULT_WEIGHT


class LimitsUpdate(StrictModel):
    """Fields left out stay as they are; a field set to null drops its override (back to the
    default from Settings)."""

    rate_per_second: float | None = Field(None, ge=0, le=1_000_000)
    rate_burst: int | None = Field(None, ge=1, le=10_000_000)
    tenant_max_active: int | None = Field(None, ge=1, le=1_000_000_000)
    queue_max_depth: dict[QueueName, Annotated[int, Field(ge=1, le=1_000_000_000)] | None] | None = None
    tenants: dict[TenantName, TenantLimit] | None = Field(None, description="Per-tenant overrides.")
    keys: dict[KeyId, KeyRateLimit] | None = Field(None, description="Per-key rate overrides.")


class KeyCreate(StrictModel):
    tenant: TenantName
    scopes: list[Scope] = Field(default_factory=lambda: list(_DEFAULT_SCOPES), min_length=1, max_length=4)
    label: KeyLabel | None = None
    allowed_networks: Networks | None = None


class KeyNetworksUpdate(StrictModel):
    """The key's new ``allowed_networks`` (replacing the old list); empty or null: any address."""

    allowed_networks: Networks | None


class KeyRotate(StrictModel):
    overlap_seconds: int = Field(
        86400, ge=0, le=MAX_ROTATION_OVERLAP_SECONDS,
        description="How long the old key keeps working beside its successor (0: it ends now; at most "
        "30 days).")


class KeyOut(BaseModel):
    key_id: str
    tenant: str
    scopes: list[str]
    label: str | None
    created_at: datetime
    revoked: bool
    revoked_at: datetime | None
    state: Literal["active", "rotating", "expired", "revoked"] = Field(
        description="rotating: rotated, still working until expires_at.")
    expires_at: datetime | None = Field(description="Refused from then on (the end of a rotation's overlap).")
    rotated_from: str | None = Field(description="The key this one succeeded in a rotation.")
    allowed_networks: list[str] = Field(description="CIDRs it may be used from; empty: any address.")
    last_used_at: datetime | None = Field(
        description="Its last use, as recorded (API processes write it at most once a minute each).")
    last_used_address: str | None


class KeyCreated(KeyOut):
    key: str = Field(description="The API key. Shown only in this response; store it now.")


class KeyRotated(KeyCreated):
    """The successor (its key shown only here) and the old key, now with its ``expires_at``."""

    previous: KeyOut


class KeyList(BaseModel):
    items: list[KeyOut]


def key_out(info: Any) -> dict[str, Any]:
    """A ``scheduler.access.api_keys.KeyInfo`` as the fields of :class:`KeyOut`."""
    return {
        "key_id": info.key_id,
        "tenant": info.tenant,
        "scopes": sorted(info.scopes),
        "label": info.label,
        "created_at": info.created_at,
        "revoked": info.revoked,
        "revoked_at": info.revoked_at,
        "state": info.state(),
        "expires_at": info.expires_at,
        "rotated_from": info.rotated_from,
        "allowed_networks": info.networks,
        "last_used_at": info.last_used_at,
        "last_used_address": info.last_used_address,
    }
