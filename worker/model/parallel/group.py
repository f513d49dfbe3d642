"""Ranks 1..N-1 of a tensor-parallel model as processes, and the proxies rank 0 runs in their stead.

The process that calls ``launch`` is rank 0. It spawns ranks 1..N-1 (``spawn`` start method:
never a fork of a process that may hold CUDA), each of which loads its own shard, then all join
one ``torch.distributed`` group (gloo on CPU, NCCL on CUDA) through a TCP store on 127.0.0.1
whose port rank 0's store picked (no free-port race). Rank ``r`` runs on ``cuda:K+r`` where
``cuda:K`` is the device asked for.

**Control and data.** The all-reduces inside a forward are collectives; everything else is a
message on a pipe per rank: rank 0's proxies (``TensorParallelModel`` in place of the model,
``TensorParallelCache`` in place of its cache) send each forward's inputs and each cache
operation (new cache, allocate, free, restore, truncate) to every rank before doing the same
locally, and the ranks execute them in order on their shard and their own cache shard. The
engine and the runner see an ordinary model and cache. Idle ranks wait on the pipe, not in a
collective, so the collective timeout only ever bounds a forward that is really running.
Forwards are serialised by one lock, so every rank issues the same collectives in the same order.

**Faults.** Every rank runs the same deterministic checks (cache room, commit lengths) before a
forward's first all-reduce, so such an error is raised on all of them alike and is an ordinary
exception on rank 0 (the engine retries the rows one by one). Anything else (a rank's process
exiting, a collective failing or timing out, an error after the first all-reduce) leaves the
ranks out of step: the group is *broken*, ``on_fatal`` runs (the worker exits non-zero there;
see ``worker/tensor_parallel.py``) and every later call raises ``TensorParallelError``. A watchdog
thread per rank on rank 0 waits for its process; ranks die with rank 0 (``PR_SET_PDEATHSIG``, armed
from a spawner thread that lives as long as the process, and the pipe's EOF) and ignore
SIGTERM/SIGINT (a signal to the whole process group is rank 0's to handle: it drains first).

Ranks are fresh interpreters (``python -m worker.model.parallel.rank``) rather than
``multiprocessing`` spawn children: exec'd at once as spawn is, but without spawn's re-import of
the parent's ``__main__`` (which runs any unguarded script or tool a second time).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch
import torch.distributed as dist

from worker.model.checkpoint import LoadedModel, read_config, read_json, weight_files
from worker.model.config import ModelConfig
from worker.model.kv_cache import CacheFullError, KVCache
from worker.model.manifest import manifest_digest, verify_manifest
from worker.model.parallel.plan import MoeMode, ShardPlan, make_plan
from worker.model.parallel.shard import Shard, build_shard, load_shard_weights
from worker.model.quant_rules import QuantMode, parse_mode
from worker.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Errors every rank raises alike before a forward's first all-reduce (same inputs, same cache
# bookkeeping): not a reason to break the group.
_IN_STEP_ERRORS = (ValueError, CacheFullError)
DEFAULT_TIMEOUT_S = 300.0  # a collective (or a rank's start-up) that takes longer is a hang
_PR_SET_PDEATHSIG = 1


class TensorParallelError(RuntimeError):
    """The tensor-parallel group is broken (a rank died, a collective failed) or cannot start."""


class ShardSource(Protocol):
    """Where a rank's weights come from (picklable: it travels to the spawned ranks)."""

    def build(self, config: ModelConfig, plan: ShardPlan, *, device: torch.device, dtype: torch.dtype,
              reduce: Callable[[torch.Tensor], None]) -> Shard: ...


@dataclass(frozen=True)
class CheckpointSource:
    """A checkpoint folder: each rank reads its slices of the memory-mapped safetensors."""

    path: str
    with_preview: bool = True

    def build(self, config: ModelConfig, plan: ShardPlan, *, device: torch.device, dtype: torch.dtype,
              reduce: Callable[[torch.Tensor], None]) -> Shard:
        shard = build_shard(config, plan, device=device, dtype=dtype, reduce=reduce)
        load_shard_weights(shard, weight_files(Path(self.path)), config, with_preview=self.with_preview)
        shard.model.eval()
        return shard


@dataclass(frozen=True)
class _RankSpec:
    source: Any
    config: ModelConfig
    rank: int
    world: int
    moe: str
    port: int
    backend: str
    device: str
    dtype: str
    threads: int
    timeout_s: float
    quant: QuantMode | None = None  # CLOVERQ_WEIGHT_DTYPE: quantize the shard (parallel/quant.py)


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


# --- messages -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Array:
    """A tensor on the wire: its numpy array (pickles without torch's storage machinery)."""

    array: np.ndarray


def _encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        cpu = value.detach().cpu()
        return cpu if cpu.dtype in (torch.bfloat16, torch.float16) else _Array(cpu.numpy())
    if isinstance(value, tuple):
        return tuple(_encode(v) for v in value)
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(value: Any, device: torch.device) -> Any:
    if isinstance(value, _Array):
        return torch.from_numpy(value.array).to(device)
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_decode(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _decode(v, device) for k, v in value.items()}
    return value


# --- rank 0 ---------------------------------------------------------------------------------------


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
        data = pickle.dumps(_encode(message), protocol=pickle.HIGHEST_PROTOCOL)
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
                    conn.send_bytes(pickle.dumps(("close",)))
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
                if counter.count == 0 and isinstance(exc, _IN_STEP_ERRORS) and self.group.broken is None:
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


def _all_reduce(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor)


def _load_device(device: torch.device, quant: QuantMode | None) -> torch.device:
    """Where a rank loads its shard: the host when it is quantized there before moving."""
    return torch.device("cpu") if quant is not None else device


def _quantize(shard: Shard, quant: QuantMode, device: torch.device) -> None:
    """Quantize a loaded shard on every rank alike (one all-reduce: row-parallel int8 scales)."""
    from worker.model.parallel.quant import quantize_shard

    def reduce_max(vector: torch.Tensor) -> torch.Tensor:
        moved = vector.to(device)  # NCCL reduces device tensors
        dist.all_reduce(moved, op=dist.ReduceOp.MAX)
        return moved.cpu()

    report = quantize_shard(shard, quant, device=device, reduce_max=reduce_max)
    log.info("rank %d of %d: %s", shard.plan.rank, shard.plan.world, report)


class _Spawner:
    """One thread that lives as long as the process and starts every rank.

    A rank's parent-death signal fires when the *thread* that started it ends, so ranks started
    from a passing thread (a model switch runs in the version follower's) would be killed when
    it stops; this thread only ends with the process.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: queue.Queue[tuple[list[str], int, Future[subprocess.Popen[bytes]]]] = queue.Queue()
        self._thread: threading.Thread | None = None

    def popen(self, argv: list[str], fd: int) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cloverq-tp-spawner", daemon=True)
                self._thread.start()
        done: Future[subprocess.Popen[bytes]] = Future()
        self._requests.put((argv, fd, done))
        return done.result()

    def _run(self) -> None:
        root = str(Path(__file__).resolve().parents[3])  # the folder holding the ``worker`` package
        while True:
            argv, fd, done = self._requests.get()
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH"))
                                                              if p)}
            try:
                done.set_result(subprocess.Popen(argv, pass_fds=(fd,), stdin=subprocess.DEVNULL, env=env))
            except BaseException as exc:
                done.set_exception(exc)


_spawner = _Spawner()


def _spawn_rank(spec: _RankSpec) -> tuple[subprocess.Popen[bytes], Connection]:
    """A fresh interpreter for one rank (exec'd at once: nothing of this process, CUDA included, is
    inherited, and unlike multiprocessing's spawn it never re-imports our ``__main__``), joined to
    us by a socket pair that carries the spec first and then the messages."""
    ours, theirs = socket.socketpair()
    try:
        argv = [sys.executable, "-m", "worker.model.parallel.rank", str(theirs.fileno()), str(os.getpid())]
        proc = _spawner.popen(argv, theirs.fileno())
    finally:
        theirs.close()
    conn = Connection(ours.detach())
    conn.send_bytes(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
    return proc, conn


def _await_loaded(proc: subprocess.Popen[bytes], conn: Connection, rank: int, deadline: float) -> None:
    while True:
        try:
            if conn.poll(0.1):
                kind, detail = pickle.loads(conn.recv_bytes())
                if kind == "loaded":
                    return
                raise TensorParallelError(f"rank {rank} failed to start:\n{detail}")
        except (EOFError, OSError):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(1.0)
        if proc.poll() is not None:
            raise TensorParallelError(f"rank {rank} exited with code {proc.returncode} while loading")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"rank {rank} did not load its shard in time")


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
    ``weight_dtype`` / ``group_size``: as ``quantize.load_model``'s; every rank loads its shard on
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
            spec = _RankSpec(source, config, r, world, moe, store.port, backend, str(devices[r]),
                             str(dtype).removeprefix("torch."), threads, timeout_s, quant)
            proc, conn = _spawn_rank(spec)
            procs.append(proc)
            conns.append(conn)
        torch.set_num_threads(threads)
        if devices[0].type == "cuda":
            torch.cuda.set_device(devices[0])
        shard = source.build(config, make_plan(config, 0, world, moe), device=_load_device(devices[0], quant),
                             dtype=dtype, reduce=_all_reduce)
        deadline = time.monotonic() + timeout_s
        for r, (proc, conn) in enumerate(zip(procs, conns, strict=True), start=1):
            _await_loaded(proc, conn, r, deadline)
        dist.init_process_group(backend, store=store, rank=0, world_size=world, timeout=timeout)
        if quant is not None:
            _quantize(shard, quant, devices[0])
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
    ``weight_dtype`` / ``group_size`` as ``quantize.load_model``'s (each rank quantizes its shard).
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


# --- ranks 1..N-1 ---------------------------------------------------------------------------------


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
        spec: _RankSpec = pickle.loads(conn.recv_bytes())
        logging.basicConfig(level=logging.WARNING, format=f"tp-rank-{spec.rank} %(levelname)s %(message)s")
        torch.set_num_threads(spec.threads)
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        plan = make_plan(spec.config, spec.rank, spec.world, spec.moe)  # type: ignore[arg-type]
        shard = spec.source.build(spec.config, plan, device=_load_device(device, spec.quant),
                                  dtype=getattr(torch, spec.dtype), reduce=_all_reduce)
        conn.send_bytes(pickle.dumps(("loaded", None)))
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore("127.0.0.1", spec.port, spec.world, is_master=False, timeout=timeout)
        dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world,
                                timeout=timeout)
        if spec.quant is not None:  # after the group is up: one all-reduce, on every rank alike
            _quantize(shard, spec.quant, device)
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
            message = _decode(pickle.loads(conn.recv_bytes()), device)
        except (EOFError, OSError):
            return 1  # rank 0 is gone without saying goodbye
        op = message[0]
        if op == "forward":
            _, cache_id, inputs = message
            counter.count = 0
            try:
                model(**inputs, cache=caches[cache_id] if cache_id is not None else None)
            except _IN_STEP_ERRORS:
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
