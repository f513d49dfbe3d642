"""Liveness and readiness responses."""

from __future__ import annotations

from pydantic import BaseModel, Field


class Health(BaseModel):
    """``/healthz``: the process is alive."""

    status: str = "ok"


class ReadinessCheck(BaseModel):
    """One dependency of readiness."""

    ok: bool
    detail: str | None = None


class Readiness(BaseModel):
    """``/readyz``: can this API accept work that will actually run?"""

    ready: bool
    checks: dict[str, ReadinessCheck]
    ready_workers: dict[str, int] = Field(
        default_factory=dict,
        description="Ready workers (model loaded and warmed up, not draining or switching) per queue.",
    )
