"""``train-demo`` pins its float path (ATen's kernels, MKL's branch) so its bytes do not depend on
the CPU: the CLI pins before the first kernel and records it, pinning too late is refused, and a
resume point computed on another path is refused rather than silently giving other bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker.model.checkpoint import SINGLE_NAME
from worker.model.demo_trained import TRAINED_CLOVER_DEMO
from worker.training.float_path import PINNED_PATH, FloatPathError, float_path, pin_float_path
from worker.training.trainer import RESUME_FILE, TRAINING_FILE, TrainConfig, TrainConfigError, train_demo

NATIVE = torch.backends.cpu.get_cpu_capability()  # this process never pins: the machine's own path
X86_WITH_AVX2 = NATIVE in ("AVX2", "AVX512")


def _train_demo_cli(folder: Path, *extra: str) -> dict[str, object]:
    """``cloverq model train-demo`` in a fresh process (its float path is chosen there): 2 steps
    from the shipped demo; its ``training.json``."""
    env = {k: v for k, v in os.environ.items() if k not in PINNED_PATH}
    command = [sys.executable, "-c", "from cli.main import main; main()", "model", "train-demo", str(folder),
               "--init-from", str(TRAINED_CLOVER_DEMO), "--steps", "2", "--batch", "4", *extra]  # fmt: skip
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=120)
    return json.loads((folder / TRAINING_FILE).read_text())


@pytest.mark.skipif(not X86_WITH_AVX2, reason="the pinned path is AVX2: an x86-64 CPU that has it")
def test_the_cli_pins_the_float_path_and_it_changes_the_bytes(tmp_path: Path) -> None:
    pinned = _train_demo_cli(tmp_path / "pinned")
    native = _train_demo_cli(tmp_path / "native", "--native-float-path")
    assert pinned["float_path"] == {"aten": "AVX2", "mkl_cbwr": "AVX2,STRICT"}
    assert native["float_path"] == {"aten": NATIVE, "mkl_cbwr": "auto"}
    if NATIVE == "AVX512":  # two paths: the pin took effect before the first kernel (2 steps suffice)
        weights = [(tmp_path / n / SINGLE_NAME).read_bytes() for n in ("pinned", "native")]
        assert weights[0] != weights[1]


@pytest.mark.skipif(NATIVE != "AVX512", reason="too late shows only where the native path is not AVX2")
def test_pinning_after_torch_chose_its_kernels_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PINNED_PATH:  # restored after the test: this process keeps its native path
        monkeypatch.setenv(name, "unset by the test")
    with pytest.raises(FloatPathError, match="before the float path was pinned"):
        pin_float_path()


def test_a_resume_point_on_another_float_path_is_refused_and_the_path_is_recorded(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    config = TrainConfig(steps=2, batch=2, save_every=1)
    folder = tmp_path / "run"
    train_demo(folder, config, max_seconds=-1.0)  # a resume point before the first step
    state = torch.load(folder / RESUME_FILE, weights_only=False)
    assert state["float_path"] == float_path()
    torch.save(dict(state, float_path={"aten": "DEFAULT", "mkl_cbwr": "SSE4_2"}), folder / RESUME_FILE)
    with pytest.raises(TrainConfigError, match="float path"):
        train_demo(folder, config)
    older = {k: v for k, v in state.items() if k != "float_path"}  # written before the record existed
    torch.save(older, folder / RESUME_FILE)
    assert train_demo(folder, config).finished
    assert json.loads((folder / TRAINING_FILE).read_text())["float_path"] == float_path()
