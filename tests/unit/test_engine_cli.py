"""``cloverq generate``: offline generation through the engine, JSON on the last stdout line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import cli
from scheduler.infra.settings import get_settings


def _run(args: list[str]) -> dict:
    result = CliRunner().invoke(cli, ["generate", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_generate_json_from_ids_is_reproducible(demo_checkpoint: Path) -> None:
    args = [
        "--model",
        str(demo_checkpoint),
        "--prompt-ids",
        "5,6,7,8,9",
        "--max-new-tokens",
        "10",
        "--steps-per-block",
        "2",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "4",
        "--json",
    ]
    first = _run(args)
    assert first == {**_run(args), "timings": first["timings"]}
    assert len(first["token_ids"]) <= 10
    assert first["finish_reason"] in ("length", "eos")
    assert first["steps_used"] <= 6  # 3 blocks (5 + 10 -> positions 5..15, block 4) x 2 steps
    assert {"load_seconds", "run_seconds"} <= set(first["timings"])


def test_generate_chat_prompt_with_budget(demo_checkpoint: Path) -> None:
    out = _run(
        [
            "--model",
            str(demo_checkpoint),
            "--prompt",
            "Hi",
            "--max-new-tokens",
            "16",
            "--block-size",
            "8",
            "--strategy",
            "dynamic",
            "--threshold",
            "0.5",
            "--step-budget",
            "3",
            "--json",
        ]
    )
    assert out["steps_used"] <= 3
    assert isinstance(out["text"], str)


def test_generate_needs_one_prompt(demo_checkpoint: Path) -> None:
    result = CliRunner().invoke(cli, ["generate", "--model", str(demo_checkpoint)])
    assert result.exit_code != 0


def test_generate_says_it_ignores_tensor_parallel(
    demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30: ``CLOVERQ_TENSOR_PARALLEL`` was ignored silently; the run is one device and says so."""
    args = ["generate", "--model", str(demo_checkpoint), "--prompt-ids", "5,6,7", "--max-new-tokens", "4",
            "--json"]  # fmt: skip
    monkeypatch.setenv("CLOVERQ_TENSOR_PARALLEL", "2")
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
    finally:
        monkeypatch.delenv("CLOVERQ_TENSOR_PARALLEL")
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    assert "CLOVERQ_TENSOR_PARALLEL=2 is ignored" in result.stderr
    assert "one device" in result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["token_ids"]  # the run itself goes on
    quiet = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert "TENSOR_PARALLEL" not in quiet.stderr
