"""An invalid ``CLOVERQ_*`` variable ends a command with one line per variable, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from scheduler.infra.settings import CONFIG_ERROR_EXIT_CODE, Settings, settings_error_lines

NOT_AN_INTEGER = "Input should be a valid integer, unable to parse string as an integer"


def _lines(**values: object) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        Settings(**values)
    lines = settings_error_lines(caught.value)
    assert lines is not None
    return sorted(lines)


def test_each_invalid_setting_is_named_by_its_variable_without_its_value() -> None:
    assert _lines(torch_threads=0, engine_max_batch="secret-xyz") == [
        f"CLOVERQ_ENGINE_MAX_BATCH: {NOT_AN_INTEGER}",
        "CLOVERQ_TORCH_THREADS: Input should be greater than or equal to 1",
    ]


def test_an_item_of_a_map_a_whole_group_and_a_value_read_from_a_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _lines(queue_max_depth={"bulk": "many"}) == [f"CLOVERQ_QUEUE_MAX_DEPTH[bulk]: {NOT_AN_INTEGER}"]
    assert _lines(queue_max_depth={"bulk": -1}) == [  # a negative cap would refuse every submit
        "CLOVERQ_QUEUE_MAX_DEPTH[bulk]: Input should be greater than or equal to 0"]
    [group] = _lines(admin_tls_cert_file=tmp_path / "cert.pem")
    assert group.startswith("settings.planes: ") and "go together" in group
    (tmp_path / "threads").write_text("two\n")
    monkeypatch.setenv("CLOVERQ_TORCH_THREADS_FILE", str(tmp_path / "threads"))
    assert _lines() == [f"CLOVERQ_TORCH_THREADS_FILE: {NOT_AN_INTEGER}"]


def test_another_models_error_is_not_taken_for_a_settings_error() -> None:
    class Other(BaseModel):
        n: int

    with pytest.raises(ValidationError) as caught:
        Other(n="x")  # type: ignore[arg-type]
    assert settings_error_lines(caught.value) is None


@pytest.mark.parametrize(("variables", "expected"), [
    ({"CLOVERQ_TORCH_THREADS": "", "CLOVERQ_ENGINE_MAX_BATCH": "secret-xyz"},
     [f"  CLOVERQ_ENGINE_MAX_BATCH: {NOT_AN_INTEGER}", f"  CLOVERQ_TORCH_THREADS: {NOT_AN_INTEGER}"]),
    ({"CLOVERQ_DATABASE_URL_FILE": "/nonexistent/url"},  # the environment source's own refusal
     ["  CLOVERQ_DATABASE_URL_FILE=/nonexistent/url: cannot read the file (No such file or directory)"]),
], ids=["validation", "source"])
def test_the_cli_exits_78_naming_the_variables_without_a_traceback(
        tmp_path: Path, variables: dict[str, str], expected: list[str]) -> None:
    env = {**os.environ, **variables, "CLOVERQ_DATA_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "cli", "keys", "list"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == CONFIG_ERROR_EXIT_CODE == 78, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert lines[-len(expected) - 1:] == ["cloverq: invalid configuration:", *expected]
    assert "secret-xyz" not in done.stderr
