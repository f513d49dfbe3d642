"""A snapshot of the engine for health checks, metrics and the terminal view."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    """Counters since start plus the current occupancy (plain values; safe to hand to any thread)."""

    running: bool
    active: dict[str, int]  # per slot class
    waiting: dict[str, int]  # per slot class
    max_batch: int
    batch_occupancy: float  # active / max_batch
    positions_in_flight: int  # KV positions reserved by active requests
    tokens_per_second: float  # committed tokens per second of engine busy time (recent window)
    steps: int  # denoising passes summed over requests (what budgets count)
    passes: int  # engine passes (each one or two batched forwards)
    forwards: int  # model forwards
    tokens_committed: int
    requests_finished: int
    requests_failed: int
    busy_seconds: float  # time inside passes
    forward_seconds: float  # time inside model forwards (the rest of busy time is overhead)
    router_counts: list[list[int]] = field(default_factory=list)  # [L, E] tokens per expert

    @property
    def overhead_share(self) -> float:
        """Share of pass time spent outside the model forward."""
        return 0.0 if self.busy_seconds <= 0 else 1.0 - self.forward_seconds / self.busy_seconds
