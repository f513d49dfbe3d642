"""Where state lives: the SQL database and Redis (``settings.database``, ``settings.redis``)."""

from __future__ import annotations

from pydantic import Field

from scheduler.infra.settings_groups.base import SettingsGroup


class DatabaseSettings(SettingsGroup):
    """SQL database: where it is and how long its operations may take."""

    url: str | None = Field(
        None, alias="database_url", description="SQLAlchemy URL; default SQLite under data_dir."
    )
    connect_timeout_seconds: float = Field(
        5.0, gt=0, alias="database_connect_timeout_seconds",
        description="Seconds to open one database connection (PostgreSQL connect_timeout, "
        "whole seconds, at least 2): a server that accepts and never answers fails fast (503).",
    )
    statement_timeout_seconds: float = Field(
        30.0, ge=0, alias="database_statement_timeout_seconds",
        description="PostgreSQL statement_timeout of every session (0: none); migrations run "
        "without it.",
    )
    lock_timeout_seconds: float = Field(
        30.0, ge=0, alias="database_lock_timeout_seconds",
        description="How long a statement waits for a lock: PostgreSQL lock_timeout (0: no "
        "bound), SQLite busy timeout (the embedded default's writers queue on one file lock).",
    )
    pool_timeout_seconds: float = Field(
        10.0, gt=0, alias="database_pool_timeout_seconds",
        description="PostgreSQL: how long a request waits for a free pooled connection "
        "before it fails (503).",
    )


class RedisSettings(SettingsGroup):
    """Redis (broker, caches, streams): where it is."""

    url: str | None = Field(
        None, alias="redis_url", description="Redis URL (redis://, rediss://, unix://, or "
        "redis+sentinel://HOST:26379,HOST:26379/SERVICE/DB to follow a Sentinel-managed master: "
        "deploy/README.md); default the embedded redis-server."
    )
    embedded_port: int = Field(
        6390, alias="embedded_redis_port", description="Port of the embedded redis-server."
    )
