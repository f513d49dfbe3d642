"""A worker whose model spans ``settings.engine.tensor_parallel`` devices (the model side:
worker/model/parallel/).

``load_sharded(runtime, path)`` is ``load_checkpoint`` for the worker runtime: this process is rank
0 and keeps the whole job flow (Celery consumer, engine thread, monitor); ranks 1..N-1 are started
here, load their slices and replay rank 0's forwards. The worker reports ``ready`` only after every
rank has loaded, joined the group and gone through the engine's warm-up pass, and its registry
entry carries ``stats.tensor_parallel`` (size, ranks ready, pids), which ``cloverq probe worker
--ready`` requires complete.

``CLOVERQ_WEIGHT_DTYPE`` (int8/int4) is applied per rank: each loads its shard on the host,
quantizes it with the single-device rules and moves it to its device (``parallel/quant.py``); an
FP8 block-scaled checkpoint is dequantized slice by slice as the ranks read it (``parallel/shard.py``).

A dying rank takes the worker down: when the group breaks (a rank's process exits, a collective
fails or times out) the worker publishes ``failed`` and leaves at once with ``EXIT_RANK_LOST``,
writing nothing for its running jobs. Their leases expire and the reaper requeues them (fenced:
an attempt of the dead worker can never write an outcome), and the supervisor or Kubernetes starts
a new worker, exactly as after a SIGKILL of a one-device worker.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, cast

import structlog

from scheduler.fleet.workers import WorkerState, heartbeat_ttl, publish_worker
from worker.model.checkpoint import LoadedModel
from worker.model.parallel.launch import load_tensor_parallel
from worker.model.parallel.proxies import TensorParallelModel

log = structlog.get_logger(__name__)

EXIT_RANK_LOST = 75  # EX_TEMPFAIL: restart me


def load_sharded(runtime: Any, path: Path) -> LoadedModel:
    """Load ``path`` over ``settings.engine.tensor_parallel`` ranks for ``runtime`` (a ``WorkerRuntime``)."""
    settings = runtime.settings
    world = settings.engine.tensor_parallel
    verify = False if settings.model.skip_verify else settings.model.verify_on_load
    loaded = load_tensor_parallel(
        path, world=world, device=settings.model.device, dtype=runtime.load_dtype(path), verify=verify,
        threads=max(1, settings.resolved_torch_threads // world),
        on_fatal=lambda reason: rank_lost(runtime, reason),
        weight_dtype=settings.model.weight_dtype, group_size=settings.model.weight_group_size,
    )
    model = cast("TensorParallelModel", loaded.model)  # LoadedModel types it as the model it stands in for
    group = model.group
    runtime.info.set_stats(tensor_parallel={
        "size": world, "ranks_ready": world, "backend": group.backend, "moe": model.moe,
        "pids": group.pids, "weight_dtype": settings.model.weight_dtype,
    })
    return loaded


def rank_lost(runtime: Any, reason: str) -> None:
    """The group broke: say ``failed`` in the registry (best effort, 2 s at most) and exit now."""
    log.error("worker.tensor_parallel_lost", worker_id=runtime.worker_id, reason=reason,
              exit_code=EXIT_RANK_LOST)
    runtime.info.state = WorkerState.FAILED

    def publish() -> None:  # on its own thread: set_stats waits for the registry lock, at most 2 s here
        stats = runtime.info.stats.get("tensor_parallel")
        if isinstance(stats, dict):
            ready = max(0, int(stats.get("size", 1)) - 1)
            runtime.info.set_stats(tensor_parallel={**stats, "ranks_ready": ready})
        ttl = heartbeat_ttl(runtime.settings.worker.heartbeat_seconds)
        publish_worker(runtime.redis, runtime.info, ttl_seconds=ttl)

    writer = threading.Thread(target=publish, name="cloverq-tp-lost", daemon=True)
    writer.start()
    writer.join(2.0)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_RANK_LOST)
