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
from worker.training import float_path as float_path_module
from worker.training.float_path import (
    CPU_MODEL_PATH,
    CPU_MODEL_RECORD,
    PINNED_PATH,
    PINNED_RECORD,
    FloatPathError,
    cpu_model,
    float_path,
    has_avx2,
    is_pinned,
    pin_float_path,
    pinned_path,
    pinned_record,
)
from worker.training.trainer import RESUME_FILE, TRAINING_FILE, TrainConfig, TrainConfigError, train_demo

NATIVE = torch.backends.cpu.get_cpu_capability()  # this test process never pins


def _train_demo_cli(folder: Path, *extra: str, env: dict[str, str] | None = None) -> dict[str, object]:
    """``cloverq model train-demo`` in a fresh process (its float path is chosen there, with none of
    the pinning variables unless ``env`` gives them): 2 steps from the shipped demo; its record."""
    child = {k: v for k, v in os.environ.items() if k not in PINNED_PATH} | (env or {})
    command = [sys.executable, "-c", "from cli.main import main; main()", "model", "train-demo", str(folder),
               "--init-from", str(TRAINED_CLOVER_DEMO), "--steps", "2", "--batch", "4", *extra]  # fmt: skip
    subprocess.run(command, env=child, check=True, capture_output=True, timeout=120)
    return json.loads((folder / TRAINING_FILE).read_text())


@pytest.mark.skipif(not has_avx2(), reason="the pinned path is AVX2: an x86-64 CPU that has it")
def test_the_cli_pins_the_float_path_before_its_first_kernel(tmp_path: Path) -> None:
    """The CLI's pin gives the bytes of a process started with the variables set (so it took
    effect before any kernel), and records what ATen and MKL report; unpinned, MKL picks its own
    branch, and on an AVX512 machine the bytes differ (2 steps suffice)."""
    pinned = _train_demo_cli(tmp_path / "pinned")
    preset = _train_demo_cli(tmp_path / "preset", "--native-float-path", env=PINNED_PATH)
    native = _train_demo_cli(tmp_path / "native", "--native-float-path")
    assert pinned["float_path"] == preset["float_path"] == {**PINNED_RECORD, "threads": 1}
    weights = {n: (tmp_path / n / SINGLE_NAME).read_bytes() for n in ("pinned", "preset", "native")}
    assert weights["pinned"] == weights["preset"]
    assert native["float_path"]["mkl_cbwr"] == "auto"  # type: ignore[index]
    if native["float_path"]["aten"] == "AVX512":  # type: ignore[index]
        assert weights["native"] != weights["pinned"]


@pytest.mark.skipif(not has_avx2(), reason="the pinned path is AVX2: an x86-64 CPU that has it")
def test_the_cpu_model_pin_is_mkls_own_branch_set_before_the_first_kernel(tmp_path: Path) -> None:
    """``--cpu-model-float-path`` gives the bytes of a process started with its variables set, and
    records ATen on AVX2, MKL on ``AUTO,STRICT`` and the CPU model; the record counts as pinned."""
    pinned = _train_demo_cli(tmp_path / "pinned", "--cpu-model-float-path")
    preset = _train_demo_cli(tmp_path / "preset", "--native-float-path", env=CPU_MODEL_PATH)
    record = {**CPU_MODEL_RECORD, "threads": 1, "cpu": cpu_model()}
    assert pinned["float_path"] == preset["float_path"] == record
    weights = [(tmp_path / name / SINGLE_NAME).read_bytes() for name in ("pinned", "preset")]
    assert weights[0] == weights[1]
    assert is_pinned(pinned["float_path"])  # type: ignore[arg-type]


def test_the_two_pins_differ_in_mkls_branch_only_and_both_count_as_pinned() -> None:
    for vendor in ("GenuineIntel", "AuthenticAMD", ""):
        own = pinned_path(vendor, cpu_model=True)
        assert own == pinned_path(vendor) | {"MKL_CBWR": "AUTO,STRICT"}
        assert pinned_record(own) == {"aten": "AVX2", "mkl_cbwr": "AUTO,STRICT"}
    assert is_pinned({**PINNED_RECORD, "threads": 2}) and is_pinned(dict(CPU_MODEL_RECORD))
    assert not is_pinned({"aten": "AVX512", "mkl_cbwr": "auto", "threads": 1})
    assert not is_pinned({"aten": "AVX2", "mkl_cbwr": "auto"})


def test_the_native_and_the_cpu_model_paths_are_refused_together(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from cli.main import cli

    result = CliRunner().invoke(cli, ["model", "train-demo", str(tmp_path / "run"), "--native-float-path",
                                      "--cpu-model-float-path", "--steps", "1"])  # fmt: skip
    assert result.exit_code == 2 and "one or the other" in result.output
    assert not (tmp_path / "run").exists()


def test_mkl_is_pinned_to_avx2_on_intel_and_to_compatible_elsewhere() -> None:
    """MKL runs its instruction-set branches on Intel CPUs only (an AMD EPYC read ``AVX2,STRICT``
    back as ``AUTO,STRICT``, its own pick per CPU model); elsewhere COMPATIBLE, the branch it runs
    on every x86-64 CPU. ATen and oneDNN are pinned to AVX2 on both."""
    intel, amd = pinned_path("GenuineIntel"), pinned_path("AuthenticAMD")
    assert intel["MKL_CBWR"] == "AVX2,STRICT"
    assert amd["MKL_CBWR"] == pinned_path("")["MKL_CBWR"] == "COMPATIBLE,STRICT"
    assert intel | {"MKL_CBWR": ""} == amd | {"MKL_CBWR": ""}
    assert pinned_record(intel) == {"aten": "AVX2", "mkl_cbwr": "AVX2,STRICT"}
    assert pinned_record(amd) == {"aten": "AVX2", "mkl_cbwr": "COMPATIBLE,STRICT"}


@pytest.mark.skipif(NATIVE != "AVX512", reason="too late shows only where the native path is not AVX2")
def test_pinning_after_torch_chose_its_kernels_is_refused_and_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.randn(8, 8) @ torch.randn(8, 8)  # ATen and MKL have chosen in this process
    for name in PINNED_PATH:  # restored after the test as well
        monkeypatch.setenv(name, "as before")
    with pytest.raises(FloatPathError, match="before the float path was pinned"):
        pin_float_path()
    assert all(os.environ[name] == "as before" for name in PINNED_PATH)
    assert float_path()["mkl_cbwr"] == "auto"


def test_a_resume_point_on_another_float_path_is_refused_and_the_path_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume point records its path and thread count; one on another path or thread count is
    refused, and so is one written before the record (on its machine's own path) when this process
    is pinned; unpinned, it resumes."""
    torch.set_num_threads(1)
    config = TrainConfig(steps=2, batch=2, save_every=1)
    folder = tmp_path / "run"
    train_demo(folder, config, max_seconds=-1.0)  # a resume point before the first step
    state = torch.load(folder / RESUME_FILE, weights_only=False)
    assert state["float_path"] == {**float_path(), "threads": 1}
    torch.save(dict(state, float_path={"aten": "DEFAULT", "mkl_cbwr": "SSE4_2"}), folder / RESUME_FILE)
    with pytest.raises(TrainConfigError, match="native-float-path"):
        train_demo(folder, config)
    torch.save(dict(state, float_path={**float_path(), "threads": 2}), folder / RESUME_FILE)
    with pytest.raises(TrainConfigError, match="'threads': 2"):  # two threads split each sum otherwise
        train_demo(folder, config)
    older = {k: v for k, v in state.items() if k != "float_path"}
    torch.save(older, folder / RESUME_FILE)
    with monkeypatch.context() as pinned:  # a pinned process, as the CLI makes it
        pinned.setattr(float_path_module, "float_path", lambda: dict(PINNED_RECORD))
        with pytest.raises(TrainConfigError, match="of its machine"):
            train_demo(folder, config)
    with monkeypatch.context() as cpu_pinned:  # on the CPU-model pin: the CPU model is recorded too
        cpu_pinned.setattr(float_path_module, "float_path", lambda: dict(CPU_MODEL_RECORD))
        cpu_pinned.setattr(float_path_module, "cpu_model", lambda: "another model")
        made_on = {**CPU_MODEL_RECORD, "threads": 1, "cpu": "a first model"}
        torch.save(dict(state, float_path=made_on), folder / RESUME_FILE)
        with pytest.raises(TrainConfigError, match="a first model"):  # made on another CPU model
            train_demo(folder, config)
        torch.save(dict(state, float_path={**PINNED_RECORD, "threads": 1}), folder / RESUME_FILE)
        with pytest.raises(TrainConfigError, match=r"COMPATIBLE|AVX2,STRICT"):  # made on the portable pin
            train_demo(folder, config)
    torch.save(older, folder / RESUME_FILE)
    assert train_demo(folder, config).finished
    assert json.loads((folder / TRAINING_FILE).read_text())["float_path"] == {**float_path(), "threads": 1}
