"""The one Settings object of cloverq (env prefix ``CLOVERQ_``).

Every process (api, worker, beat, CLI) reads its configuration here and nowhere else, so a
value means the same thing in every component. Nothing in the code base reads ``os.environ``
for configuration.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Configuration of one cloverq deployment."""

    model_config = SettingsConfigDict(env_prefix="CLOVERQ_", extra="ignore")

    # --- where state lives -------------------------------------------------------------------
    data_dir: Path = Field(Path(".cloverq"), description="State of the embedded default.")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default SQLite under data_dir.")
    redis_url: str | None = Field(None, description="Redis URL; default the embedded redis-server.")
    embedded_redis_port: int = Field(6390, description="Port of the embedded redis-server.")

    # --- model -------------------------------------------------------------------------------
    model_dir: Path | None = Field(None, description="Checkpoint folder; default the demo checkpoint.")
    device: str = Field("cpu", description="torch device for the model: cpu, cuda, cuda:N.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    skip_verify: bool = Field(False, description="Load a checkpoint even if its manifest fails.")
    model_root: Path | None = Field(
        None, description="Model store: <model_root>/<name>/<version>/; default data_dir/model-store."
    )

    # --- engine ------------------------------------------------------------------------------
    engine_max_batch: int = Field(16, ge=1, description="Sequences in one batched forward.")
    engine_max_tokens_in_flight: int = Field(65536, ge=1, description="KV positions held at once.")

    # --- request limits and defaults -----------------------------------------------------------
    max_prompt_tokens: int = Field(4096, ge=1)
    max_new_tokens_limit: int = Field(2048, ge=1)
    default_max_new_tokens: int = Field(128, ge=1)
    default_steps_per_block: int = Field(4, ge=1)
    max_steps_per_block: int = Field(64, ge=1)
    max_step_budget: int = Field(8192, ge=1)
    max_body_bytes: int = Field(1_048_576, ge=1024)

    # --- logging -----------------------------------------------------------------------------
    log_level: str = "INFO"
    log_payloads: bool = Field(False, description="Log prompts, contexts and outputs (off by default).")

    @property
    def resolved_database_url(self) -> str:
        """The database to use: ``database_url`` or SQLite under ``data_dir``."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'cloverq.db').resolve()}"

    @property
    def resolved_redis_url(self) -> str:
        """The Redis to use: ``redis_url`` or the embedded server started by ``cloverq up``."""
        if self.redis_url:
            return self.redis_url
        return f"redis://127.0.0.1:{self.embedded_redis_port}/0"

    @property
    def resolved_model_dir(self) -> Path:
        """The checkpoint to serve: ``model_dir`` or the demo checkpoint under ``data_dir``."""
        return self.model_dir or (self.data_dir / "models" / "demo")

    @property
    def resolved_model_root(self) -> Path:
        """The model store root: ``model_root`` or ``data_dir/model-store``."""
        return self.model_root or (self.data_dir / "model-store")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
