"""What every group of ``Settings`` shares: its base class and the list parsing of its
environment values."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict


class SettingsGroup(BaseModel):
    """One concern's settings; its fields validate by nested name and by flat name (alias)."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)


def split_list(value: Any) -> Any:
    """A JSON list or comma-separated text (environment) -> a list of stripped items."""
    if isinstance(value, str):
        text = value.strip()
        value = json.loads(text) if text.startswith("[") else text.split(",")
    if isinstance(value, (list, tuple)):
        return [str(item).strip() for item in value if str(item).strip()]
    return value
