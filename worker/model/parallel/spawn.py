"""Starting ranks 1..N-1: each a fresh interpreter joined to rank 0 by a socket pair.

Ranks are fresh interpreters (``python -m worker.model.parallel.rank``) rather than
``multiprocessing`` spawn children: exec'd at once as spawn is (never a fork of a process that
may hold CUDA), but without spawn's re-import of the parent's ``__main__`` (which runs any
unguarded script or tool a second time). The pipe carries the rank's ``RankSpec`` first, then
its ``loaded`` (or ``error``) answer, then rank 0's messages (``pipe_codec.py``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from worker.model.config import ModelConfig
from worker.model.parallel.errors import TensorParallelError
from worker.model.quant_rules import QuantMode


@dataclass(frozen=True)
class RankSpec:
    """What one rank needs to load its shard and join the group (the first message on its pipe)."""

    source: Any  # a ShardSource (sources.py)
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


def spawn_rank(spec: RankSpec) -> tuple[subprocess.Popen[bytes], Connection]:
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


def await_loaded(proc: subprocess.Popen[bytes], conn: Connection, rank: int, deadline: float) -> None:
    """Wait for rank ``rank`` to report its shard loaded (TensorParallelError: failed, exited, late)."""
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
