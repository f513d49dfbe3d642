"""bench/system_cpu.py: CPU seconds per process group from /proc, and the bound they set; and
bench/system.py's explanation of a run from them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import system, system_cpu

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_cpu_seconds_counts_this_process_and_its_threads() -> None:
    before = system_cpu.snapshot({"me": [os.getpid()]}, watch_threads=["me"])
    _spin(0.3)
    reading = time.thread_time()
    after = system_cpu.snapshot({"me": [os.getpid()]}, watch_threads=["me"])
    reading = time.thread_time() - reading
    used = system_cpu.usage(before, after, top=1)
    assert 0.2 <= used.seconds["me"] <= 2.0
    # this (main) thread spun: its seconds are the process's, give or take a clock tick on each
    # figure and the CPU it spent between the two reads of a snapshot (the process's total is read
    # before its threads'; a loaded CI run saw 0.31 against 0.29)
    assert 0.2 <= used.top_threads["me"] <= used.seconds["me"] + 0.02 + reading


def test_a_group_counts_its_descendants(tmp_path: Path) -> None:
    spun = tmp_path / "spun"
    child = tmp_path / "child.py"
    child.write_text("import sys, time\n"
                     "end = time.process_time() + 0.3\n"
                     "while time.process_time() < end: pass\n"  # ~0.3 s of CPU
                     "open(sys.argv[1], 'w').close()\n"  # says so: on a loaded machine the
                     "time.sleep(30)\n")  # spin takes longer than any fixed wait (a CI run saw 0.16 s)
    # the parent spins too: a process's /proc CPU counts whole clock ticks, and a bare interpreter's
    # start-up (~20 ms) sometimes counted none (a CI run saw "alone" at 0.0)
    code = ("import subprocess, sys, time; end = time.process_time() + 0.1\n"
            "while time.process_time() < end: pass\n"
            "subprocess.run([sys.executable, sys.argv[1], sys.argv[2]])")
    parent = subprocess.Popen([sys.executable, "-c", code, str(child), str(spun)])
    try:
        deadline = time.monotonic() + 30
        while not spun.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert spun.exists()  # the child's spin is done
        assert len(system_cpu.descendants(parent.pid)) == 2
        taken = system_cpu.snapshot({"tree": [parent.pid], "alone": [parent.pid]}, alone=["alone"])
        assert taken.groups["alone"] > 0.0
        assert taken.groups["tree"] - taken.groups["alone"] >= 0.2  # the child's seconds only in "tree"
    finally:
        for pid in reversed(system_cpu.descendants(parent.pid)):
            os.kill(pid, 9)
        parent.wait()
    assert system_cpu.cpu_seconds(parent.pid) == 0.0  # gone: nothing, never an error


def test_bound_scales_the_engine_by_what_the_rest_leaves() -> None:
    share, bound = system_cpu.bound(200.0, other_cpu_seconds=10.0, wall_seconds=50.0, cores=2)
    assert share == pytest.approx(0.1)
    assert bound == pytest.approx(180.0)
    assert system_cpu.bound(200.0, 500.0, 50.0, 2) == (1.0, 0.0)
    assert system_cpu.bound(200.0, 1.0, 0.0, 2) == (0.0, 200.0)


def test_explain_counts_only_the_workers_cpu_beyond_the_engine_alone() -> None:
    engine = system.Measured("engine", 1, 100, 6400, 40.0, cpu={"engine": 76.0}, cpu_wall=40.0,
                             engine_busy=39.0, passes=400)
    stack = system.Measured("stack", 1, 100, 6400, 50.0, cpu={"worker-0": 80.0, "api": 6.0, "beat": 1.0,
                                                              "redis": 1.0, "client": 2.0},
                            worker_top_threads=77.0, cpu_wall=50.0, engine_busy=45.0, passes=420,
                            batch=[0, 20, 20, 19, 3])
    explained = system.explain(engine, stack, cores=2)
    # non-engine: the worker's 4 s beyond the engine's 76 s, plus 6 + 1 + 1 + 2 = 14 s of 100 core-s
    assert explained["non_engine_share"] == pytest.approx(0.14)
    assert explained["bound_tokens_per_second"] == pytest.approx(160.0 * 0.86)
    assert explained["bound_ratio"] == pytest.approx(0.86)
    assert explained["engine_cpu_per_job_ms"] == pytest.approx(760.0)
    text = "\n".join(explained["lines"])
    assert "= 14.0%" in text and "median 20" in text
