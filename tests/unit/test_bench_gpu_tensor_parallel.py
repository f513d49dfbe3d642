"""``bench.gpu --tensor-parallel 2`` still runs end to end, on CPU (gloo) at a reduced shape.

Nothing is timed: this keeps the TP path of the GPU benchmark from rotting between the rare runs on
a multi-GPU machine (the script's own test, tests/unit/test_deploy_bench_gpu.py, covers TP=1).
"""

from __future__ import annotations

import pytest

from bench import gpu

TINY_TP = [
    "--device", "cpu", "--dtype", "float32", "--layers", "2", "--experts", "8", "--top-k", "2",
    "--hidden", "64", "--moe-intermediate", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
    "--vocab", "256", "--batches", "1,2", "--block-sizes", "4", "--new-tokens", "4",
    "--prompt-tokens", "5", "--copy-mb", "8", "--tensor-parallel", "2",
]  # fmt: skip


def test_bench_runs_with_two_ranks_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu.main(TINY_TP) == 0
    out = capsys.readouterr().out
    assert "tensor parallel: 2 (columns)" in out and "model (rank 0)" in out
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(1, 4), (2, 4)]
    assert all(int(r[3]) == int(r[0]) * 4 for r in rows)  # every sequence got its tokens
