"""Starting a tensor-parallel model: ``load_tensor_parallel`` (a checkpoint folder) and ``launch``.

The process that calls ``launch`` is rank 0. It spawns ranks 1..N-1 (``spawn.py``), each of which
loads its own shard (``rank_server.py``), then all join one ``torch.distributed`` group (gloo on
CPU, NCCL on CUDA) through a TCP store on 127.0.0.1 whose port rank 0's store picked (no
free-port race). Rank ``r`` runs on ``cuda:K+r`` where ``cuda:K`` is the device asked for. What
``launch`` returns is rank 0's proxy of the whole model (``proxies.py``). The group this process
started last is closed by ``close_active`` (a model switch, and at interpreter exit).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from worker.model.checkpoint import LoadedModel, read_config, read_json
from worker.model.config import ModelConfig
from worker.model.manifest import manifest_digest, verify_manifest
from worker.model.parallel.errors import TensorParallelError
from worker.model.parallel.plan import MoeMode, make_plan
from worker.model.parallel.proxies import RankGroup, TensorParallelModel
from worker.model.parallel.quant import quantize_in_group
from worker.model.parallel.sources import CheckpointSource, ShardSource, build_rank_shard
from worker.model.parallel.spawn import RankSpec, await_loaded, spawn_rank
from worker.model.quant_rules import QuantMode, parse_mode
from worker.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0  # a collective (or a rank's start-up) that takes longer is a hang


def rank_devices(device: torch.device | str, world: int) -> list[torch.device]:
    """Rank ``r``'s device: ``cuda:K+r`` for ``cuda:K`` (``cuda`` = ``cuda:0``); CPU for all on CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return [device] * world
    if device.type != "cuda":
        raise TensorParallelError(f"tensor parallelism runs on cuda or cpu, not {device.type}")
    first = device.index or 0
    available = torch.cuda.device_count()
    if first + world > available:
        raise TensorParallelError(
            f"tensor_parallel={world} from {device} needs cuda:{first}..cuda:{first + world - 1}, "
            f"but {available} CUDA devices are visible"
        )
    return [torch.device("cuda", first + r) for r in range(world)]


_active: RankGroup | None = None


def close_active() -> None:
    """Close the group this process started last (a model switch loads the next one after it)."""
    global _active
    if _active is not None:
        _active.close()
        _active = None


atexit.register(close_active)  # a clean interpreter exit ends the ranks too


def launch(
    source: ShardSource,
    config: ModelConfig,
    *,
    world: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    threads: int | None = None,
    moe: MoeMode = "columns",
    on_fatal: Callable[[str], None] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    weight_dtype: QuantMode | str | None = None,
    group_size: int | None = None,
) -> TensorParallelModel:
    """Start ranks 1..``world``-1, build rank 0's shard here, join them; returns rank 0's proxy.

    ``threads``: torch threads of each rank (default: this process's count split ``world`` ways).
    ``on_fatal(reason)`` runs once when the group breaks (the worker exits there).
    ``weight_dtype`` / ``group_size``: as ``loader.load_model``'s; every rank loads its shard on
    the host, quantizes it there (``parallel/quant.py``) and moves it to its device.
    """
    quant = parse_mode(weight_dtype, group_size)
    global _active
    if world < 2:
        raise ValueError("launch needs world >= 2 (world 1 is the plain model)")
    if dist.is_initialized():
        raise TensorParallelError("this process already belongs to a torch.distributed group")
    for r in range(world):
        make_plan(config, r, world, moe)  # refuse shapes that do not split before spawning anything
    devices = rank_devices(device, world)
    backend = "nccl" if devices[0].type == "cuda" else "gloo"
    threads = threads or max(1, torch.get_num_threads() // world)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
    procs: list[subprocess.Popen[bytes]] = []
    conns: list[Any] = []
    try:
        for r in range(1, world):
            spec = RankSpec(source, config, r, world, moe, store.port, backend, str(devices[r]),
                            str(dtype).removeprefix("torch."), threads, timeout_s, quant)
            proc, conn = spawn_rank(spec)
            procs.append(proc)
            conns.append(conn)
        torch.set_num_threads(threads)
        if devices[0].type == "cuda":
            torch.cuda.set_device(devices[0])
        shard = build_rank_shard(source, config, make_plan(config, 0, world, moe), device=devices[0],
                                 dtype=dtype, quant=quant)
        deadline = time.monotonic() + timeout_s
        for r, (proc, conn) in enumerate(zip(procs, conns, strict=True), start=1):
            await_loaded(proc, conn, r, deadline)
        dist.init_process_group(backend, store=store, rank=0, world_size=world, timeout=timeout)
        if quant is not None:
            quantize_in_group(shard, quant, devices[0])
    except BaseException:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(5.0)
        for conn in conns:
            conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    group = RankGroup(procs, conns, backend=backend, on_fatal=on_fatal)
    _active = group
    log.info("tensor-parallel group of %d ranks up (%s, pids %s)", world, backend, group.pids)
    return TensorParallelModel(shard, group, config)


def load_tensor_parallel(
    path: Path | str,
    *,
    world: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    verify: bool | Literal["full", "quick"] = True,
    threads: int | None = None,
    moe: MoeMode = "columns",
    on_fatal: Callable[[str], None] | None = None,
    weight_dtype: QuantMode | str | None = None,
    group_size: int | None = None,
) -> LoadedModel:
    """``load_checkpoint`` for ``world`` ranks: rank 0 verifies the folder, every rank loads its slices.

    ``verify`` as ``load_checkpoint``'s (``True``/``"full"``, ``"quick"``, or no check);
    ``weight_dtype`` / ``group_size`` as ``loader.load_model``'s (each rank quantizes its shard).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise TensorParallelError(f"checkpoint folder {folder} does not exist")
    report = verify_manifest(folder, mode="full" if verify is True else verify) if verify else None
    config = read_config(folder)
    tokenizer = Tokenizer.from_dir(folder)
    trunk_only = config.family == "clover" and config.model_type not in ("clover_moe", "clover_moe_text")
    close_active()  # a previous model's ranks (model switch) free their devices first
    model = launch(CheckpointSource(str(folder), with_preview=not trunk_only), config, world=world,
                   device=device, dtype=dtype, threads=threads, moe=moe, on_fatal=on_fatal,
                   weight_dtype=weight_dtype, group_size=group_size)
    gen = folder / "generation_config.json"
    return LoadedModel(
        model=model,  # type: ignore[arg-type]  # a stand-in with the model's interface
        config=config,
        tokenizer=tokenizer,
        generation_config=read_json(gen) if gen.is_file() else {},
        path=folder,
        manifest_digest=manifest_digest(folder),
        verification=report,
    )
