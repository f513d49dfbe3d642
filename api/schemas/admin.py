"""Request and response models of the admin API (``/v1/admin``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from api.schemas.common import storable_text
from scheduler.jobs.models import QueueName

TenantName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")]
KeyId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{12}$")]
Scope = Literal["submit", "read", "admin"]
_DEFAULT_SCOPES: tuple[Scope, ...] = ("read", "submit")
KeyLabel = Annotated[str, StringConstraints(max_length=200), AfterValidator(storable_text)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class LimitsOut(BaseModel):
    defaults: LimitValues = Field(description="From Settings (environment).")
    effective: LimitValues = Field(description="What global rules use now.")
    overrides: dict[str, float] = Field(description="Runtime overrides in Redis, per field.")


class KeyRateLimit(_Strict):
    rate_per_second: float | None = Field(None, ge=0, le=1_000_000)
    rate_burst: int | None = Field(None, ge=1, le=10_000_000)


class TenantLimit(_Strict):
    max_active: int | None = Field(None, ge=1, le=1_000_000_000)


class LimitsUpdate(_Strict):
    """Fields left out stay as they are; a field set to null drops its override (back to the
    default from Settings)."""

    rate_per_second: float | None = Field(None, ge=0, le=1_000_000)
    rate_burst: int | None = Field(None, ge=1, le=10_000_000)
    tenant_max_active: int | None = Field(None, ge=1, le=1_000_000_000)
    queue_max_depth: dict[QueueName, Annotated[int, Field(ge=1, le=1_000_000_000)] | None] | None = None
    tenants: dict[TenantName, TenantLimit] | None = Field(None, description="Per-tenant overrides.")
    keys: dict[KeyId, KeyRateLimit] | None = Field(None, description="Per-key rate overrides.")


class KeyCreate(_Strict):
    tenant: TenantName
    scopes: list[Scope] = Field(default_factory=lambda: list(_DEFAULT_SCOPES), min_length=1, max_length=3)
    label: KeyLabel | None = None


class KeyOut(BaseModel):
    key_id: str
    tenant: str
    scopes: list[str]
    label: str | None
    created_at: datetime
    revoked: bool
    revoked_at: datetime | None


class KeyCreated(KeyOut):
    key: str = Field(description="The API key. Shown only in this response; store it now.")


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
    }
