"""API-key authentication and admission control (``settings.security``, ``settings.admission``;
scheduler/access/api_keys.py, scheduler/access/admission.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt

from scheduler.infra.queue_names import QueueName
from scheduler.infra.settings_groups.base import SettingsGroup


class SecuritySettings(SettingsGroup):
    """API-key authentication (scheduler/access/api_keys.py)."""

    auth: Literal["enabled", "disabled"] = Field(
        "enabled", description="API-key authentication; 'disabled' only for local development."
    )
    auth_cache_seconds: float = Field(
        5.0, ge=0, description="How long an API process caches a looked-up key (revocation bound)."
    )


class AdmissionSettings(SettingsGroup):
    """Admission control (scheduler/access/admission.py): per-key rate, per-tenant and per-queue caps."""

    rate_limit_per_second: float = Field(
        50.0, ge=0, description="Per-key token-bucket refill rate (requests/s); 0 disables the limit."
    )
    rate_limit_burst: int = Field(100, ge=1, description="Per-key token-bucket size (requests).")
    tenant_max_active_jobs: int = Field(
        1000, ge=1, description="Per-tenant cap on queued + running jobs; more submits get 429."
    )
    tenant_count_cache_seconds: float = Field(
        1.0, ge=0, description="How long an API process trusts its tenant active-job count while far "
        "below the cap (near the cap it always counts in SQL); 0 counts every submit.",
    )
    queue_max_depth: dict[str, NonNegativeInt] = Field(
        default_factory=lambda: {QueueName.INTERACTIVE.value: 1000, QueueName.STANDARD.value: 5000,
                                 QueueName.BULK.value: 20000, QueueName.JOINT.value: 500},
        description="Per-queue cap on waiting messages; a submit routed to a full queue gets 429.",
    )
