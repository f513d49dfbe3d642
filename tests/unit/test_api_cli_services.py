"""Pure helpers of ``cloverq up`` and the client commands."""

from __future__ import annotations

from pathlib import Path

import click
import httpx
import pytest

from cli.api_client import click_error
from cli.services import ALL_QUEUES, _child_env, _redact_url, _settings_overrides
from client import CloverqError
from scheduler.settings import Settings


def test_up_pins_absolute_paths_and_embedded_urls_for_its_children(tmp_path: Path) -> None:
    settings = Settings(embedded_redis_port=7001)
    overrides = _settings_overrides(settings, tmp_path)
    assert overrides["data_dir"] == tmp_path
    assert overrides["redis_url"] == "redis://127.0.0.1:7001/0"
    assert overrides["database_url"] == f"sqlite:///{tmp_path / 'cloverq.db'}"
    assert overrides["worker_queues"] == ALL_QUEUES  # the one embedded worker serves every queue
    env = _child_env(settings, tmp_path)
    assert env["CLOVERQ_DATA_DIR"] == str(tmp_path)
    assert env["CLOVERQ_REDIS_URL"] == "redis://127.0.0.1:7001/0"


def test_up_keeps_configured_services_and_queues(tmp_path: Path) -> None:
    settings = Settings(database_url="postgresql+psycopg://u@db/x", redis_url="redis://r:6379/2",
                        worker_queues="interactive")
    overrides = _settings_overrides(settings, tmp_path)
    assert "database_url" not in overrides
    assert overrides["redis_url"] == "redis://r:6379/2"
    assert overrides["worker_queues"] == "interactive"


@pytest.mark.parametrize(
    ("url", "shown"),
    [("postgresql+psycopg://user:secret@db:5432/x", "postgresql+psycopg://user:***@db:5432/x"),
     ("postgresql+psycopg://user@db/x", "postgresql+psycopg://user@db/x"),
     ("sqlite:////tmp/a.db", "sqlite:////tmp/a.db")],
)
def test_database_passwords_are_never_printed(url: str, shown: str) -> None:
    assert _redact_url(url) == shown


def test_client_errors_carry_the_api_code_and_message() -> None:
    response = httpx.Response(422, json={"error": {"code": "invalid_request", "message": "bad",
                                                   "details": [{"loc": ["body"]}]}})
    error = click_error(CloverqError.from_response(response))
    assert isinstance(error, click.ClickException)
    assert "invalid_request (HTTP 422): bad" in error.message
    assert '"loc"' in error.message  # the details follow
