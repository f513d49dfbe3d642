"""A tensor-parallel group whose ranks die: rank 0 learns of it at once, ranks never outlive rank 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT, wait_for
from worker.model.parallel.errors import TensorParallelError
from worker.model.parallel.launch import close_active, load_tensor_parallel


def test_a_killed_rank_breaks_the_group_and_calls_on_fatal_once(demo_checkpoint: Path) -> None:
    reasons: list[str] = []
    told = threading.Event()

    def on_fatal(reason: str) -> None:
        reasons.append(reason)
        told.set()

    loaded = load_tensor_parallel(demo_checkpoint, world=2, threads=1, verify="quick", on_fatal=on_fatal)
    assert loaded.verification is not None and loaded.verification.mode == "quick"
    tp = loaded.model
    try:
        ids = torch.zeros(1, 4, dtype=torch.long)
        pos = torch.arange(4)[None]
        tp(ids, pos, pos)  # a working group first
        rank1 = tp.group.procs[0]  # type: ignore[attr-defined]
        os.kill(rank1.pid, signal.SIGKILL)
        assert told.wait(10), "rank 0 never noticed"
        assert "rank 1" in reasons[0] and "-9" in reasons[0]
        with pytest.raises(TensorParallelError, match="broken"):
            tp(ids, pos, pos)
        with pytest.raises(TensorParallelError):
            tp.new_cache(max_seqs=1, max_len=8, device="cpu", dtype=torch.float32)
        assert len(reasons) == 1
    finally:
        close_active()


_RANK0 = """
import os, sys
from worker.model.parallel.launch import load_tensor_parallel
tp = load_tensor_parallel(sys.argv[1], world=2, threads=1, verify=False).model
print(tp.group.procs[0].pid, flush=True)
os._exit(0)  # rank 0 vanishes without closing anything
"""


def test_ranks_exit_when_rank_0_vanishes(demo_checkpoint: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _RANK0, str(demo_checkpoint)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[-1])

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as stat:  # a zombie awaiting its (already gone) parent counts
            return stat.read().split(")")[-1].split()[0] == "Z"

    began = time.monotonic()
    wait_for(gone, timeout=10, message="rank 1 to exit after rank 0")
    assert time.monotonic() - began < 10
