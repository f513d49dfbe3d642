"""``cloverq up`` restarts a worker or beat that exits, whatever its exit code, within a budget."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from cli.supervisor import RestartBudget, Supervisor


def test_restart_budget_allows_a_few_restarts_per_window_then_refuses() -> None:
    budget = RestartBudget(max_restarts=2, window_seconds=10.0)
    assert budget.allow(0.0) and budget.allow(1.0)
    assert not budget.allow(2.0)  # a process that cannot stay up fails loudly
    assert budget.allow(11.5)  # the first restart left the window


def test_a_child_that_exited_zero_is_started_again_in_its_place(tmp_path: Path) -> None:
    supervisor = Supervisor(log_dir=tmp_path)
    first = supervisor.start("redis", [sys.executable, "-c", "import time; time.sleep(30)"], env={})
    quitter = supervisor.start("worker", [sys.executable, "-c", "print('bye')"], env={"X": "1"})
    try:
        deadline = time.monotonic() + 10
        while quitter.alive and time.monotonic() < deadline:
            time.sleep(0.02)
        assert quitter.process.returncode == 0
        assert supervisor.first_dead() is quitter
        fresh = supervisor.restart(quitter)
        assert fresh is not quitter and fresh.argv == quitter.argv and fresh.env == {"X": "1"}
        assert [child.name for child in supervisor.children] == ["redis", "worker"]
        assert supervisor.children[0] is first
        while fresh.alive and time.monotonic() < deadline + 10:
            time.sleep(0.02)
    finally:
        supervisor.stop_all()
    assert (tmp_path / "worker.log").read_text().count("bye") == 2  # both runs wrote to its log
