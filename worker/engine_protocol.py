"""What the worker needs from an engine: a typed ``Protocol`` instead of ``Any`` and ``getattr``.

The job runner, the model switcher and the registry heartbeat only ever use these members of
``worker.engine.engine.Engine``. Typing them here keeps the worker honest about that surface
(mypy checks that ``Engine`` still provides it where ``worker/resident_model.py`` builds one)
and lets tests hand the worker a small fake engine without importing torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

from worker.engine.stats import EngineStats
from worker.engine.types import GenerationRequest, GenerationResult


class ServingEngine(Protocol):
    """The engine one worker process serves its jobs on (``worker.engine.engine.Engine``)."""

    @property
    def default_block_size(self) -> int:
        """The checkpoint's block size: used when a job's params name none."""
        ...

    def start(self) -> None: ...

    def warm_up(self) -> None:
        """Run one small request end to end; raises if it does not complete."""
        ...

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None: ...

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]: ...

    def submit_many(self, requests: Sequence[GenerationRequest]) -> list[Future[GenerationResult]]:
        """Queue ``requests`` in one admission round (shared prompt prefixes prefill once)."""
        ...

    def stats(self) -> EngineStats: ...
