"""Webhook deliveries (``settings.webhooks``)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from scheduler.access.networks import normalised_networks
from scheduler.infra.settings_groups.base import SettingsGroup, split_list


class WebhookSettings(SettingsGroup):
    """Webhook deliveries: retries, timeout, which non-public targets are allowed, the beat's sweep."""

    max_attempts: int = Field(
        5, ge=1, alias="webhook_max_attempts", description="Deliveries tried before a webhook is given up."
    )
    backoff_base_seconds: float = Field(
        1.0, ge=0, alias="webhook_backoff_base_seconds", description="Webhook retry n waits base*2^(n-1)."
    )
    backoff_max_seconds: float = Field(
        300.0, ge=0, alias="webhook_backoff_max_seconds", description="Cap of the webhook backoff."
    )
    timeout_seconds: float = Field(
        5.0, gt=0, alias="webhook_timeout_seconds", description="Timeout of one webhook POST."
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, alias="webhook_allowed_hosts",
        description="Webhook URL hosts (names or addresses, comma-separated or a JSON "
        "list) delivered to although they resolve to loopback, private, link-local or other non-public "
        "addresses, which are refused otherwise.",
    )
    allowed_networks: Annotated[list[str], NoDecode] = Field(
        default_factory=list, alias="webhook_allowed_networks",
        description="CIDR networks (comma-separated or a JSON list, e.g. 10.8.0.0/16) "
        "webhook targets may resolve into although they are not public.",
    )
    sweep_interval_seconds: float = Field(
        10.0, gt=0, alias="webhook_sweep_interval_seconds",
        description="Beat: record missed webhook deliveries and re-publish lost ones.",
    )
    progress_interval_seconds: float = Field(
        10.0, ge=0.1, alias="webhook_progress_interval_seconds",
        description="At most one job.progress webhook per job per this long (webhook_events: progress).",
    )

    @field_validator("allowed_hosts", "allowed_networks", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        return split_list(value)

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        return [host.lower().rstrip(".").strip("[]") for host in value]

    @field_validator("allowed_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        return normalised_networks(value)  # a ValueError refuses the setting
