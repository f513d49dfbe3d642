"""Rank 0's stand-ins: the model and cache its engine drives, replaying every call on ranks 1..N-1.

**Control and data.** The all-reduces inside a forward are collectives; everything else is a
message on a pipe per rank: rank 0's proxies (``TensorParallelModel`` in place of the model,
``TensorParallelCache`` in place of its cache) send each forward's inputs and each cache
operation (new cache, allocate, free, restore, truncate) to every rank before doing the same
locally, and the ranks execute them in order on their shard and their own cache shard
(``rank_server.py``). The engine and the runner see an ordinary model and cache. Idle ranks wait
on the pipe, not in a collective, so the collective timeout only ever bounds a forward that is
really running. Forwards are serialised by one lock, so every rank issues the same collectives in
the same order.

**Faults.** Every rank runs the same deterministic checks (cache room, commit lengths) before a
forward's first all-reduce, so such an error is raised on all of them alike and is an ordinary
exception on rank 0 (the engine retries the rows one by one). Anything else (a rank's process
exiting, a collective failing or timing out, an error after the first all-reduce) leaves the
ranks out of step: the group is *broken*, ``on_fatal`` runs (the worker exits non-zero there;
see ``worker/tensor_parallel.py``) and every later call raises ``TensorParallelError``. A watchdog
thread per rank on rank 0 waits for its process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from worker.model.config import ModelConfig
from worker.model.kv_cache import KVCache
from worker.model.parallel.errors import IN_STEP_ERRORS, TensorParallelError
from worker.model.parallel.pipe_codec import pack
from worker.model.parallel.shard import Shard

log = logging.getLogger(__name__)


class RankGroup:
    """Rank 0's handle on ranks 1..N-1: their processes and pipes, the lock, the broken flag."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], conns: list[Connection], *, backend: str,
                 on_fatal: Callable[[str], None] | None) -> None:
        self.procs = procs
        self.conns = conns
        self.backend = backend
        self.world = len(procs) + 1
        self.on_fatal = on_fatal
        self.lock = threading.RLock()
        self.broken: str | None = None
        self._closing = False
        self._dropped: list[int] = []  # caches collected since the last message (sent with the next)
        self._next_cache = 0
        for rank, proc in enumerate(procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"cloverq-tp-watch-{rank}",
                             daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [os.getpid(), *(p.pid for p in self.procs)]

    def new_cache_id(self) -> int:
        self._next_cache += 1
        return self._next_cache

    def check(self) -> None:
        if self.broken is not None:
            raise TensorParallelError(f"the tensor-parallel group is broken: {self.broken}")

    def send(self, message: tuple[Any, ...]) -> None:
        """One message to every rank, in order with every other message (caller holds ``lock``)."""
        self.check()
        dropped, self._dropped = self._dropped, []
        try:
            for cache_id in dropped:
                self._write(("drop", cache_id))
            self._write(message)
        except (OSError, EOFError, ValueError) as exc:  # a pipe to a dead rank
            raise self.fatal(f"lost the pipe to a rank: {exc!r}") from exc

    def post(self, message: tuple[Any, ...]) -> None:
        """``send`` taking the lock (cache operations)."""
        with self.lock:
            self.send(message)

    def _write(self, message: tuple[Any, ...]) -> None:
        data = pack(message)
        for conn in self.conns:
            conn.send_bytes(data)

    def fatal(self, reason: str) -> TensorParallelError:
        """Mark the group broken (once), tell ``on_fatal``; returns the error for the caller to raise."""
        first = self.broken is None
        if first:
            self.broken = reason
            log.error("tensor-parallel group broken: %s", reason)
            if self.on_fatal is not None and not self._closing:
                self.on_fatal(reason)
        return TensorParallelError(f"the tensor-parallel group is broken: {self.broken}")

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not self._closing:
            self.fatal(f"rank {rank} (pid {proc.pid}) exited with code {code}")

    def close(self, timeout: float = 10.0) -> None:
        """Tell the ranks to exit, wait for them (then kill), leave the process group."""
        if self._closing:
            return
        self._closing = True
        with self.lock:
            for conn in self.conns:
                with contextlib.suppress(OSError, EOFError, ValueError):
                    conn.send_bytes(pack(("close",)))
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class TensorParallelCache:
    """Rank 0's cache shard; allocate/free/restore/truncate are replayed on every rank."""

    def __init__(self, local: KVCache, group: RankGroup, cache_id: int) -> None:
        self.local = local
        self.group = group
        self.id = cache_id

    def allocate(self) -> int:
        with self.group.lock:
            self.group.check()
            slot = self.local.allocate()
            self.group.send(("allocate", self.id, slot))
        return slot

    def free(self, slot: int) -> None:
        with self.group.lock:
            self.local.free(slot)
            self.group.send(("free", self.id, slot))

    def restore(self, slots: torch.Tensor, snapshot: tuple[torch.Tensor, ...]) -> None:
        with self.group.lock:
            self.local.restore(slots, snapshot)
            self.group.send(("restore", self.id, slots, snapshot))

    def truncate(self, slot: int, length: int) -> None:
        with self.group.lock:
            self.local.truncate(slot, length)
            self.group.send(("truncate", self.id, slot, length))

    def snapshot(self, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.local.snapshot(slots)  # the same on every rank: restore sends it along

    def num_free(self) -> int:
        return self.local.num_free()

    def __getattr__(self, name: str) -> Any:  # device, lengths, max_len, bytes_per_position, ...
        return getattr(self.local, name)

    def __del__(self) -> None:  # only queued: the next message carries it (no I/O in a finaliser)
        with contextlib.suppress(Exception):
            self.group._dropped.append(self.id)


class TensorParallelModel:
    """What the engine holds instead of the model: rank 0's shard, driving ranks 1..N-1.

    Same call signature and ``new_cache`` as the model; ``config`` is the whole model's. Logits
    come from rank 0 (the LM head is whole there; other ranks return none).
    """

    def __init__(self, shard: Shard, group: RankGroup, config: ModelConfig) -> None:
        self.shard = shard
        self.group = group
        self.config = config
        self.world = group.world
        self.moe = shard.plan.moe

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.shard.model.parameters()

    def eval(self) -> TensorParallelModel:
        return self

    def new_cache(self, *, max_seqs: int, max_len: int, device: torch.device | str,
                  dtype: torch.dtype) -> TensorParallelCache:
        with self.group.lock:
            self.group.check()
            cache_id = self.group.new_cache_id()
            local = self.shard.model.new_cache(max_seqs=max_seqs, max_len=max_len, device=device, dtype=dtype)
            self.group.send(("cache", cache_id, dict(max_seqs=max_seqs, max_len=max_len,
                                                      dtype=str(dtype).removeprefix("torch."))))
        return TensorParallelCache(local, self.group, cache_id)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block_ids: torch.Tensor | None = None,
        *,
        valid: torch.Tensor | None = None,
        cache: TensorParallelCache | None = None,
        slots: torch.Tensor | None = None,
        commit_lens: torch.Tensor | None = None,
        router_counts: torch.Tensor | None = None,
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if cache is not None and not isinstance(cache, TensorParallelCache):
            raise TypeError("a tensor-parallel model runs on the cache its new_cache made")
        inputs = dict(input_ids=input_ids, positions=positions, block_ids=block_ids, valid=valid,
                      slots=slots, commit_lens=commit_lens, logits_index=logits_index)
        counter = self.shard.counter
        with self.group.lock:
            self.group.send(("forward", cache.id if cache is not None else None, inputs))
            counter.count = 0
            try:
                return self.shard.model(**inputs, cache=cache.local if cache is not None else None,
                                        router_counts=router_counts)
            except Exception as exc:
                if counter.count == 0 and isinstance(exc, IN_STEP_ERRORS) and self.group.broken is None:
                    raise  # every rank raised it too, before any collective: still in step
                raise self.group.fatal(
                    f"forward failed on rank 0 after {counter.count} all-reduces: {exc!r}"
                ) from exc

    def probe_all_reduce(self, numel: int, count: int = 100) -> float:
        """Mean seconds of one all-reduce of ``numel`` elements across the ranks (diagnostics)."""
        param = next(self.parameters())
        with self.group.lock:
            self.group.send(("probe", numel, count))
            tensor = torch.zeros(numel, device=param.device, dtype=param.dtype)
            began = time.perf_counter()
            for _ in range(count):
                dist.all_reduce(tensor)
            if tensor.device.type == "cuda":
                torch.cuda.synchronize(tensor.device)
            return (time.perf_counter() - began) / count

    def close(self) -> None:
        self.group.close()
