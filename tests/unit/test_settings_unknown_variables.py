"""A misspelt ``CLOVERQ_`` variable is named at start, with the setting it most resembles
(``scheduler/infra/settings_env.py`` ``unknown_variables``; logged by ``configure_logging``)."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from scheduler.infra.settings import Settings
from scheduler.infra.settings_env import NOT_SETTINGS, NOT_SETTINGS_PREFIX, flat_table, unknown_variables
from scheduler.observability.logging import configure_logging

REPO = Path(__file__).resolve().parents[2]


def test_typos_are_named_with_the_setting_they_resemble() -> None:
    environ = {
        "CLOVERQ_ENGINE_MAX_BACTH": "3", "CLOVERQ_BEAT_LEASE_SECOND": "5", "CLOVERQ_LOGLEVEL": "debug",
        "CLOVERQ_SOMETHING_ELSE": "1",
        # no mistakes: settings (any case), a setting's _FILE form, the suite's and compose's own
        "CLOVERQ_ENGINE_MAX_BATCH": "4", "cloverq_log_level": "info", "CLOVERQ_DATABASE_URL_FILE": "/x",
        "CLOVERQ_TEST_REDIS_URL": "redis://127.0.0.1", "CLOVERQ_MODEL_NAME": "clover", "PATH": "/bin",
    }
    assert unknown_variables(environ, Settings) == {
        "CLOVERQ_BEAT_LEASE_SECOND": "CLOVERQ_BEAT_LEASE_SECONDS",
        "CLOVERQ_ENGINE_MAX_BACTH": "CLOVERQ_ENGINE_MAX_BATCH",
        "CLOVERQ_LOGLEVEL": "CLOVERQ_LOG_LEVEL",
        "CLOVERQ_SOMETHING_ELSE": None,
    }


def test_every_variable_the_repository_sets_is_known() -> None:
    """What deploy/, the CI script, the Makefile, bench/ and tests/ set is a setting or listed as no
    setting on purpose: none of it draws the warning (a fragment such as ``CLOVERQ_ENGINE_*`` in prose
    is skipped, and so are the settings tests, which give wrong names on purpose)."""
    known = {entry.env for entry in flat_table(Settings).values()}
    known |= {name + "_FILE" for name in known} | NOT_SETTINGS
    paths = [REPO / ".ci" / "run", REPO / "Makefile"]
    for folder in ("deploy", "bench", "tests"):
        paths += [p for p in (REPO / folder).rglob("*")
                  if p.is_file() and p.suffix not in {".pyc", ".safetensors"}
                  and not p.name.startswith("test_settings_")]
    found: dict[str, Path] = {}
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="ignore")
        for match in re.finditer(r"CLOVERQ_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_*])", text):
            found.setdefault(match.group(0), path)
    strays = {name: str(path.relative_to(REPO)) for name, path in found.items()
              if name not in known and not name.startswith(NOT_SETTINGS_PREFIX)}
    assert strays == {}


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    yield io.StringIO()
    structlog.reset_defaults()
    logging.getLogger().handlers.clear()


def test_a_process_logs_its_unknown_variables_at_start(
    log_stream: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLOVERQ_ENGINE_MAX_BACTH", "3")
    configure_logging(Settings(), stream=log_stream)
    lines = [json.loads(line) for line in log_stream.getvalue().splitlines()]
    warned = [line for line in lines if line["event"] == "settings.unknown_variables"]
    assert len(warned) == 1
    assert "CLOVERQ_ENGINE_MAX_BACTH" in warned[0]["variables"]
    assert warned[0]["did_you_mean"]["CLOVERQ_ENGINE_MAX_BACTH"] == "CLOVERQ_ENGINE_MAX_BATCH"
    assert warned[0]["level"] == "warning"
