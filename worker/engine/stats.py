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
    # prompt prefill and the prefix cache (worker/engine/prefix_cache.py; zeros while it is off)
    prefill_positions: int = 0  # prompt positions run through the model, shared prefixes included
    prefill_chunks: int = 0  # prompt chunks prefilled between passes (worker/engine/prefill_chunks.py)
    prefix_reused_positions: int = 0  # prompt positions copied from a shared prefix instead
    prefix_cache_hits: int = 0  # sequences started from a stored prefix
    prefix_cache_misses: int = 0  # sequences with whole prompt blocks that found none stored
    prefix_cache_evictions: int = 0
    prefix_cache_stores: int = 0  # prefixes computed and stored
    prefix_cache_entries: int = 0
    prefix_cache_bytes: int = 0  # bytes the stored prefixes hold now (K/V, and GDN states)
    prefix_cache_budget_bytes: int = 0  # its budget; 0: prefix sharing is off

    @property
    def overhead_share(self) -> float:
        """Share of pass time spent outside the model forward."""
        return 0.0 if self.busy_seconds <= 0 else 1.0 - self.forward_seconds / self.busy_seconds

    @property
    def prefix_hit_rate(self) -> float:
        """Share of prefix lookups (sequences with whole prompt blocks) that hit a stored prefix."""
        lookups = self.prefix_cache_hits + self.prefix_cache_misses
        return 0.0 if lookups == 0 else self.prefix_cache_hits / lookups
