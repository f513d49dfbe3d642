"""The CLI client (``settings.client``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from scheduler.infra.settings_groups.base import SettingsGroup


class ClientSettings(SettingsGroup):
    """The CLI client (cloverq submit / jobs / cancel)."""

    api_url: str = Field(
        "http://127.0.0.1:8000",
        description="Where the CLI client finds the API; unset: the stack `cloverq up` recorded.",
    )
    admin_api_url: str | None = Field(
        None, description="Where the CLI client finds the admin plane (`cloverq top`) when the API serves it "
        "on a port of its own; unset: the recorded stack's, else api_url.")
    ops_api_url: str | None = Field(
        None, description="Where the CLI client finds the ops plane (/readyz); unset: the recorded stack's, "
        "else api_url.")
    api_key: str | None = Field(
        None, description="CLI client key; unset: data_dir/dev_api_key, else the recorded stack's dev key.")
    stack_file: Path | None = Field(
        None, description="Where `cloverq up` records its URL and data dir so the CLI finds them from any "
        "folder; default $XDG_STATE_HOME/cloverq/stack.json (~/.local/state/cloverq/stack.json).",
    )
