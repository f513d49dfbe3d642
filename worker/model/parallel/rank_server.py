"""Ranks 1..N-1: load the shard, join the group, then execute rank 0's messages until ``close``.

Started by ``spawn.spawn_rank`` as ``python -m worker.model.parallel.rank FD PID``. A rank dies
with rank 0 (``PR_SET_PDEATHSIG``, armed from the spawner thread that lives as long as rank 0's
process, and the pipe's EOF) and ignores SIGTERM/SIGINT (a signal to the whole process group is
rank 0's to handle: it drains first, then tells the ranks to close).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from worker.model.kv_cache import KVCache
from worker.model.parallel.errors import IN_STEP_ERRORS, TensorParallelError
from worker.model.parallel.pipe_codec import unpack
from worker.model.parallel.plan import make_plan
from worker.model.parallel.quant import quantize_in_group
from worker.model.parallel.shard import Shard
from worker.model.parallel.sources import build_rank_shard
from worker.model.parallel.spawn import RankSpec

_PR_SET_PDEATHSIG = 1


def _die_with(parent_pid: int) -> None:
    """Exit when rank 0 does: the kernel's parent-death signal, and a check that it is still there."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # rank 0 died before the signal was armed
        os._exit(1)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 drains and then tells us to close
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def rank_main(fd: int, parent_pid: int) -> None:
    """Entry of ranks 1..N-1 (``python -m worker.model.parallel.rank FD PID``)."""
    _die_with(parent_pid)
    conn = Connection(fd)
    try:
        spec: RankSpec = pickle.loads(conn.recv_bytes())
        logging.basicConfig(level=logging.WARNING, format=f"tp-rank-{spec.rank} %(levelname)s %(message)s")
        torch.set_num_threads(spec.threads)
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        plan = make_plan(spec.config, spec.rank, spec.world, spec.moe)  # type: ignore[arg-type]
        shard = build_rank_shard(spec.source, spec.config, plan, device=device,
                                 dtype=getattr(torch, spec.dtype), quant=spec.quant)
        conn.send_bytes(pickle.dumps(("loaded", None)))
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore("127.0.0.1", spec.port, spec.world, is_master=False, timeout=timeout)
        dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world,
                                timeout=timeout)
        if spec.quant is not None:  # after the group is up: one all-reduce, on every rank alike
            quantize_in_group(shard, spec.quant, device)
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        os._exit(1)
    try:
        code = _serve(shard, conn, device)
    except BaseException:
        print(f"tp-rank-{spec.rank}: fatal error\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        code = 1
    os._exit(code)


def _serve(shard: Shard, conn: Any, device: torch.device) -> int:
    """Execute rank 0's messages in order until ``close`` (0) or rank 0 is gone (1)."""
    model, counter = shard.model, shard.counter
    caches: dict[int, KVCache] = {}
    while True:
        try:
            message = unpack(conn.recv_bytes(), device)
        except (EOFError, OSError):
            return 1  # rank 0 is gone without saying goodbye
        op = message[0]
        if op == "forward":
            _, cache_id, inputs = message
            counter.count = 0
            try:
                model(**inputs, cache=caches[cache_id] if cache_id is not None else None)
            except IN_STEP_ERRORS:
                if counter.count:
                    raise
                continue  # rank 0 raised the same before any collective
        elif op == "cache":
            _, cache_id, kw = message
            caches[cache_id] = model.new_cache(max_seqs=kw["max_seqs"], max_len=kw["max_len"], device=device,
                                               dtype=getattr(torch, kw["dtype"]))
        elif op == "allocate":
            _, cache_id, slot = message
            got = caches[cache_id].allocate()
            if got != slot:
                raise TensorParallelError(f"cache slot {got} allocated where rank 0 got {slot}")
        elif op == "free":
            caches[message[1]].free(message[2])
        elif op == "restore":
            caches[message[1]].restore(message[2], message[3])
        elif op == "truncate":
            caches[message[1]].truncate(message[2], message[3])
        elif op == "probe":
            param = next(model.parameters())
            tensor = torch.zeros(message[1], device=param.device, dtype=param.dtype)
            for _ in range(message[2]):
                dist.all_reduce(tensor)
        elif op == "drop":
            caches.pop(message[1], None)
        elif op == "close":
            if dist.is_initialized():
                dist.destroy_process_group()
            return 0
        else:
            raise TensorParallelError(f"unknown message {op!r}")
