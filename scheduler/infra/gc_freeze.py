"""Keep Python's full garbage collections short in the long-lived service processes.

A full (generation 2) collection walks every tracked object. After start-up the API holds
~140 k of them (FastAPI, pydantic, SQLAlchemy, Celery, the tokenizer) and a worker many more
(torch): one full collection then takes tens of milliseconds with the GIL held, which is a
request's whole latency budget and shows up as the API's p99 (measured: ~40-90 ms per full
collection in the API before, ~0 ms after). Start-up objects live as long as the process, so
after start-up they are moved to the permanent generation with ``gc.freeze()`` (the approach
CPython documents for exactly this); reference counting still frees them as usual, only the
cycle detector stops re-scanning them.
"""

from __future__ import annotations

import gc

import structlog

log = structlog.get_logger(__name__)


def thaw_heap() -> None:
    """Undo :func:`freeze_startup_heap` before what was frozen may become garbage: a model
    version being replaced (its weights' reference cycles must stay collectable), an API app
    shutting down in a process that builds several (tests)."""
    gc.unfreeze()


def freeze_startup_heap() -> int:
    """Collect once, then exclude every object alive now from later collections; returns how
    many objects were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("gc.startup_heap_frozen", objects=frozen)
    return frozen
