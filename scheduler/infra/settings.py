"""The one Settings object of cloverq (env prefix ``CLOVERQ_``).

Every process (api, worker, beat, CLI) reads its configuration here and nowhere else, so a
value means the same thing in every component. Nothing in the code base reads ``os.environ``
for configuration.

Settings are grouped by concern into nested models, and code reads them nested
(``settings.engine.max_batch``, ``settings.database.url``)::

    data_dir        the root folder every embedded default lives under (the one top-level field)
    database        SQL: URL and timeouts            redis           URL, embedded server port
    model           checkpoint, dtype, store         canary          canary releases
    engine          the batched inference engine     limits          request limits and defaults
    jobs            retries, leases, deadlines       scheduling      cost classes and aging
    worker          worker process                   beat            maintenance process
    security        API-key authentication           admission       rate limits and caps
    decisions       decision jobs                    thinking        thinking generate jobs
    batches         batch jobs                       webhooks        webhook deliveries
    planes          API listeners, allow-lists, TLS
    client          the CLI client                   observability   logs, metrics, readiness

Every field keeps its **flat name**, the name it had before the grouping: the field's pydantic
``alias`` where the nested name differs (``engine.max_batch`` has alias ``engine_max_batch``),
else the nested name itself (``limits.max_prompt_tokens``). The flat name is

* its environment variable: ``CLOVERQ_`` + flat name in capitals (``CLOVERQ_ENGINE_MAX_BATCH``),
  unless the field names another one (``json_schema_extra={"env": ...}``: only
  ``PROMETHEUS_MULTIPROC_DIR``, which prometheus-client itself reads);
* its keyword: ``Settings(engine_max_batch=4)`` is the alias of ``Settings(engine={"max_batch": 4})``,
  and ``settings.replaced(engine_max_batch=4)`` a validated copy with that change;
* what ``settings.to_env()`` writes for a subprocess.

``flat_fields()`` derives that one table from the declarations; there is no second list.

Each group is declared in a module of its own under ``scheduler/infra/settings_groups/``, named
after its concern (``storage``: database and redis; ``model``: model and canary; ``engine``;
``limits``; ``jobs``: jobs and scheduling; ``processes``: worker and beat; ``access``: security
and admission; ``workloads``: decisions, thinking and batches; ``webhooks``; ``planes``;
``client``; ``observability``). The flat names and the environment source are
``scheduler/infra/settings_env.py``. This module composes the groups into ``Settings``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from scheduler.infra.settings_env import ENV_PREFIX, FlatEnvSource, FlatField, flat_table, nest
from scheduler.infra.settings_groups.access import AdmissionSettings, SecuritySettings
from scheduler.infra.settings_groups.base import SettingsGroup
from scheduler.infra.settings_groups.client import ClientSettings
from scheduler.infra.settings_groups.engine import EngineSettings
from scheduler.infra.settings_groups.jobs import JobSettings, SchedulingSettings
from scheduler.infra.settings_groups.limits import CHAT_TEMPLATE_SLACK_TOKENS, LimitSettings
from scheduler.infra.settings_groups.model import CanarySettings, ModelSettings
from scheduler.infra.settings_groups.observability import ObservabilitySettings
from scheduler.infra.settings_groups.planes import PlaneSettings
from scheduler.infra.settings_groups.processes import BeatSettings, WorkerSettings
from scheduler.infra.settings_groups.storage import DatabaseSettings, RedisSettings
from scheduler.infra.settings_groups.webhooks import WebhookSettings
from scheduler.infra.settings_groups.workloads import BatchSettings, DecisionSettings, ThinkingSettings


class Settings(BaseSettings):
    """Configuration of one cloverq deployment."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    data_dir: Path = Field(Path(".cloverq"), description="State of the embedded default.")
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    canary: CanarySettings = Field(default_factory=CanarySettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    jobs: JobSettings = Field(default_factory=JobSettings)
    scheduling: SchedulingSettings = Field(default_factory=SchedulingSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    beat: BeatSettings = Field(default_factory=BeatSettings)
    security: SecuritySettings = Field(default_factory=SecuritySettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    decisions: DecisionSettings = Field(default_factory=DecisionSettings)
    thinking: ThinkingSettings = Field(default_factory=ThinkingSettings)
    batches: BatchSettings = Field(default_factory=BatchSettings)
    webhooks: WebhookSettings = Field(default_factory=WebhookSettings)
    planes: PlaneSettings = Field(default_factory=PlaneSettings)
    client: ClientSettings = Field(default_factory=ClientSettings)
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Keywords first, then the environment under the flat names (no .env file, no secrets dir)."""
        return init_settings, FlatEnvSource(settings_cls)

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_names(cls, data: Any) -> Any:
        """Flat names (keywords, ``model_validate``) -> their groups; a flat value wins over a nested one."""
        return nest(data, flat_fields()) if isinstance(data, Mapping) else data

    def replaced(self, **changes: Any) -> Settings:
        """A validated copy with ``changes`` (flat names, or whole groups by group name)."""
        unknown = set(changes) - set(flat_fields()) - set(type(self).model_fields)
        if unknown:
            raise TypeError(f"not a setting: {', '.join(sorted(unknown))}")
        return type(self).model_validate({**self.model_dump(), **changes})

    def flat_value(self, flat_name: str) -> Any:
        """The value of the setting with this flat name (``engine_max_batch`` -> ``engine.max_batch``)."""
        entry = flat_fields()[flat_name]
        owner = self if entry.group is None else getattr(self, entry.group)
        return getattr(owner, entry.name)

    def to_env(self) -> dict[str, str]:
        """Environment variables that reproduce these settings in a subprocess (unset values left out)."""
        env: dict[str, str] = {}
        for entry in flat_fields().values():
            value = self.flat_value(entry.flat)
            if value is None:
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, (dict, list, tuple)):
                text = json.dumps(value)
            else:
                text = str(value)
            env[entry.env] = text
        return env

    @property
    def resolved_database_url(self) -> str:
        """The database to use: ``database.url`` or SQLite under ``data_dir``."""
        if self.database.url:
            return self.database.url
        return f"sqlite:///{(self.data_dir / 'cloverq.db').resolve()}"

    @property
    def resolved_redis_url(self) -> str:
        """The Redis to use: ``redis.url`` or the embedded server started by ``cloverq up``."""
        if self.redis.url:
            return self.redis.url
        return f"redis://127.0.0.1:{self.redis.embedded_port}/0"

    @property
    def broker_visibility_timeout_seconds(self) -> float:
        """Redis redelivery timeout: above the longest deadline, so no running job is redelivered.

        ``jobs.visibility_timeout_seconds`` overrides it (the chaos tests set it below a job's run
        time to show that a redelivered running job is fenced off and runs once).
        """
        if self.jobs.visibility_timeout_seconds is not None:
            return self.jobs.visibility_timeout_seconds
        longest = max(self.jobs.deadline_seconds, self.jobs.joint_deadline_seconds,
                      self.thinking.deadline_seconds)
        return 2 * longest + self.jobs.lease_seconds

    @property
    def resolved_engine_max_len(self) -> int:
        """Per-sequence KV length of the engine: ``engine.max_len``, or room for the largest request
        the API accepts (the chat template's tokens included; whole blocks of any size dividing 64)."""
        if self.engine.max_len is not None:
            return self.engine.max_len
        needed = self.limits.max_prompt_tokens + CHAT_TEMPLATE_SLACK_TOKENS + self.limits.max_new_tokens_limit
        return -(-needed // 64) * 64

    @property
    def resolved_torch_threads(self) -> int:
        """Threads torch uses for one worker's ops: ``engine.torch_threads``, else
        ``OMP_NUM_THREADS`` (the variable torch itself honours: a worker that set the cores count
        over it would oversubscribe a machine shared by several processes), else the CPUs this
        process may run on (its affinity: a container pinned to 4 of 64 cores gets 4)."""
        return self.engine.torch_threads or omp_num_threads() or available_cpus()

    @property
    def resolved_model_dir(self) -> Path:
        """The checkpoint to serve: ``model.dir`` or the demo checkpoint under ``data_dir`` (an
        absolute path, so a process started elsewhere finds the same folder)."""
        return (self.model.dir or (self.data_dir / "models" / "demo")).expanduser().absolute()

    @property
    def resolved_model_root(self) -> Path:
        """The model store root: ``model.root`` or ``data_dir/model-store``."""
        return (self.model.root or (self.data_dir / "model-store")).expanduser().absolute()


def flat_fields() -> dict[str, FlatField]:
    """Every setting by flat name, in declaration order (derived from the field declarations)."""
    return flat_table(Settings)


def settings_groups() -> dict[str, type[SettingsGroup]]:
    """The nested groups of ``Settings`` by attribute name, in declaration order."""
    return {name: field.annotation for name, field in Settings.model_fields.items()
            if isinstance(field.annotation, type) and issubclass(field.annotation, SettingsGroup)}


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()


CONFIG_ERROR_EXIT_CODE = 78  # EX_CONFIG (sysexits.h): a process refuses its configuration


def omp_num_threads() -> int | None:
    """``OMP_NUM_THREADS`` when it is a positive integer (OpenMP's own rule), else None."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdecimal() and value.isascii() and int(value) > 0 else None


def available_cpus() -> int:
    """The CPUs this process may run on (``sched_getaffinity``), or the machine's count where the
    platform has no affinity call."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def settings_error_lines(error: ValidationError) -> list[str] | None:
    """One line per invalid setting of ``error`` (raised by ``Settings``), each naming where the
    value came from and pydantic's reason; None when ``error`` is not a ``Settings`` error.

    The name is the environment variable (``CLOVERQ_X``, or ``CLOVERQ_X_FILE`` when the value was
    read from that file), with the key of a map's or list's item (``CLOVERQ_QUEUE_MAX_DEPTH[bulk]``);
    an error of a whole group (two settings that go together) names ``settings.GROUP``. pydantic's
    type errors never repeat the input, so a URL or a key is not echoed."""
    if error.title != Settings.__name__:
        return None
    by_path = {entry.path: entry.env for entry in flat_fields().values()}
    return [f"{_error_source(tuple(str(part) for part in item['loc']), by_path)}: {item['msg']}"
            for item in error.errors()]


def _error_source(loc: tuple[str, ...], by_path: Mapping[str, str]) -> str:
    """The variable behind the error at ``loc`` (its longest prefix that is a setting)."""
    for end in range(len(loc), 0, -1):
        env = by_path.get(".".join(loc[:end]))
        if env is None:
            continue
        if env not in os.environ and f"{env}_FILE" in os.environ:
            env = f"{env}_FILE"
        return env + (f"[{'.'.join(loc[end:])}]" if loc[end:] else "")
    return "settings" + "".join(f".{part}" for part in loc)
