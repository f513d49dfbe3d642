"""The tensor-parallel group's error, and the errors that leave its ranks in step."""

from __future__ import annotations

from worker.model.kv_cache import CacheFullError


class TensorParallelError(RuntimeError):
    """The tensor-parallel group is broken (a rank died, a collective failed) or cannot start."""


# Errors every rank raises alike before a forward's first all-reduce (same inputs, same cache
# bookkeeping): not a reason to break the group.
IN_STEP_ERRORS = (ValueError, CacheFullError)
