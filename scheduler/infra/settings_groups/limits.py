"""What one request may ask for and the API's HTTP size limits (``settings.limits``)."""

from __future__ import annotations

from pydantic import Field

from scheduler.infra.settings_groups.base import SettingsGroup

# Positions the chat template adds around a prompt (max_prompt_tokens counts the prompt's text only).
CHAT_TEMPLATE_SLACK_TOKENS = 64


class LimitSettings(SettingsGroup):
    """What one request may ask for, the defaults it gets, and the HTTP size limits of the API."""

    max_prompt_tokens: int = Field(
        16_384, ge=1, description="Prompt tokens a job may send; the checkpoint's context "
        "(max_position_embeddings) caps it further (scheduler/fleet/context_limits.py). The default lets a "
        "16K-token contract through; engine memory per sequence grows with it (engine_max_len).",
    )
    max_new_tokens_limit: int = Field(2048, ge=1)
    default_max_new_tokens: int = Field(128, ge=1)
    default_steps_per_block: int | None = Field(
        None,
        ge=1,
        description="Steps per block when a request names none; unset: the model family's default "
        "(Clover and LLaDA2: the block size; SDAR: 4).",
    )
    max_steps_per_block: int = Field(64, ge=1)
    max_step_budget: int = Field(8192, ge=1)
    max_body_bytes: int = Field(1_048_576, ge=1024)
    max_header_bytes: int = Field(
        32_768, ge=1024, description="cloverq api: bytes of a request's head (request line and headers); "
        "a larger one is refused with 431 as it arrives.",
    )
    max_header_count: int = Field(
        100, ge=8, description="cloverq api: header lines of one request; more are refused with 431.",
    )
    header_timeout_seconds: float = Field(
        10.0, gt=0, description="cloverq api: from a request head's first byte to its end; a slower head "
        "(slowloris) is answered 408 and the connection closed.",
    )
    idle_timeout_seconds: float = Field(
        15.0, gt=0, description="cloverq api: how long a new connection may stay silent before its first "
        "request; then it is closed. Between requests the keep-alive timeout (cloverq api --keep-alive) "
        "applies.",
    )
    max_connections: int = Field(
        900, ge=1, description="cloverq api: open connections one process serves; beyond it (and the health "
        "reserve) a new one is answered 503 too_many_connections and closed at once. Lowered to fit the "
        "process's file-descriptor limit (raised to its hard limit at start).",
    )
    health_connections: int = Field(
        32, ge=1, description="cloverq api: connections beyond max_connections that may still ask "
        "/healthz, /readyz and /metrics, so probes answer while the API is full.",
    )
    max_metadata_bytes: int = Field(
        16_384, ge=64,
        description="Bytes of a job's (or batch's) metadata as compact UTF-8 JSON; larger is refused (422).",
    )
    max_schema_bytes: int = Field(
        16_384, ge=64,
        description="Bytes of a response_schema (OpenAI response_format json_schema) as JSON; larger is "
        "refused with 400 schema_too_large.",
    )
    max_schema_depth: int = Field(
        6, ge=1, le=32,
        description="Nesting of objects, arrays and anyOf in a response_schema; deeper is refused with 400 "
        "schema_too_large.",
    )
    max_tools: int = Field(
        128, ge=1, le=4096,
        description="Functions in one request's tools (OpenAI tools); more are refused with 400 "
        "too_many_tools. Each tool's parameters count against max_schema_bytes / max_schema_depth.",
    )
    list_max_response_bytes: int = Field(
        4 * 1024 * 1024, ge=65_536,
        description="GET /v1/jobs ends a page before this many bytes (next_cursor goes on from there); "
        "a page always holds at least one job.",
    )
