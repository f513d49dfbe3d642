"""The checkpoint a worker serves and its canary releases (``settings.model``, ``settings.canary``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from scheduler.infra.settings_groups.base import SettingsGroup


class ModelSettings(SettingsGroup):
    """The checkpoint a worker serves: where it is, how it is loaded, which store model it follows."""

    dir: Path | None = Field(
        None, alias="model_dir", description="Checkpoint folder; default the demo checkpoint."
    )
    device: str = Field("cpu", description="torch device for the model: cpu, cuda, cuda:N.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Weights and compute dtype; default the checkpoint's (config.json dtype or "
        "torch_dtype), float32 when it names none.",
    )
    weight_dtype: Literal["int8", "int4"] | None = Field(
        None, description="Worker: weight-only quantization at load (expert and projection matrices; "
        "embeddings, LM head, norms, routers and GDN gates keep dtype): int8 per output channel or int4 "
        "in groups of weight_group_size. Default: none, the weights stay in dtype.",
    )
    weight_group_size: int = Field(
        64, description="Worker: int4 group along the input dim (weight_dtype=int4): 32, 64 or 128.",
    )
    skip_verify: bool = Field(False, description="Load a checkpoint even if its manifest fails.")
    verify_on_load: Literal["quick", "full"] = Field(
        "quick", description="Manifest check when a worker loads a checkpoint: quick (sizes and sampled "
        "chunks of every file, the hashes recorded at pull trusted) or full (every byte re-hashed).",
    )
    root: Path | None = Field(
        None, alias="model_root",
        description="Model store: <model_root>/<name>/<version>/; default data_dir/model-store.",
    )
    served: str | None = Field(
        None, alias="served_model",
        description="Worker: serve this store model and follow its active version (cloverq model "
        "activate); unset: serve model_dir as is. API and beat: route jobs by this model's canary.",
    )
    served_initial_version: str | None = Field(
        None, alias="served_model_initial_version",
        description="Worker: version of served_model to activate when none is active yet.",
    )
    watch_interval_seconds: float = Field(
        2.0, gt=0, alias="model_watch_interval_seconds",
        description="Worker: how often it checks the active version of served_model.",
    )

    @field_validator("weight_group_size")
    @classmethod
    def _group_size(cls, value: int) -> int:
        if value not in (32, 64, 128):
            raise ValueError("weight_group_size must be 32, 64 or 128")
        return value


class CanarySettings(SettingsGroup):
    """Canary releases (scheduler/model_versions/canary.py, docs/architecture.md "Canary releases")."""

    track: Literal["stable", "canary"] = Field(
        "stable", alias="model_track",
        description="Worker: canary workers serve the canary version of served_model while "
        "one is in effect (cloverq model canary), stable ones the active version.",
    )
    min_jobs: int = Field(
        50, ge=0, alias="canary_min_jobs",
        description="Promotion is refused until the canary finished this many jobs (--force overrides).",
    )
    error_margin: float = Field(
        0.01, ge=0, le=1, alias="canary_error_margin",
        description="Promotion is refused when the canary's error rate exceeds the "
        "stable one's by more than this (--force overrides).",
    )
    require_golden: bool = Field(
        False, alias="canary_require_golden",
        description="Promotion is refused unless the canary version's last golden check passed "
        "(cloverq model golden check; --force overrides).",
    )
    reroute_seconds: float = Field(
        60.0, gt=0, alias="canary_reroute_seconds",
        description="A canary job queued this long while no canary worker is registered "
        "is re-routed to the stable version (reconciler).",
    )
