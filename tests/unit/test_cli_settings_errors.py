"""An invalid ``CLOVERQ_*`` variable ends a command with one line per variable, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import BaseModel, ValidationError

from scheduler.infra.settings import Settings, settings_error_lines


def test_each_invalid_setting_is_named_by_its_variable_without_its_value() -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(torch_threads=0, engine_max_batch="secret-xyz")
    lines = settings_error_lines(caught.value)
    assert lines is not None and sorted(lines) == [
        "CLOVERQ_ENGINE_MAX_BATCH: Input should be a valid integer, unable to parse string as an integer",
        "CLOVERQ_TORCH_THREADS: Input should be greater than or equal to 1",
    ]


def test_another_models_error_is_not_taken_for_a_settings_error() -> None:
    class Other(BaseModel):
        n: int

    with pytest.raises(ValidationError) as caught:
        Other(n="x")  # type: ignore[arg-type]
    assert settings_error_lines(caught.value) is None


def test_the_cli_exits_2_with_the_variables_and_no_traceback(tmp_path: os.PathLike[str]) -> None:
    env = {**os.environ, "CLOVERQ_TORCH_THREADS": "", "CLOVERQ_ENGINE_MAX_BATCH": "secret-xyz",
           "CLOVERQ_DATA_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "cli", "worker"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "secret-xyz" not in done.stderr
    assert done.stderr.splitlines() == [
        "cloverq: invalid configuration:",
        "  CLOVERQ_ENGINE_MAX_BATCH: Input should be a valid integer, unable to parse string as an integer",
        "  CLOVERQ_TORCH_THREADS: Input should be a valid integer, unable to parse string as an integer",
    ]
