"""The CLI from any folder (issue 33): ``cloverq up`` records its URL and data dir, the client
commands find the key and URL through that record when nothing closer is given, and a refusal
says what was sent (no key at all, or which key) and how to give one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
import pytest

from cli import stack_record
from cli.api_client import click_error, resolve_target
from cli.top import fetch_overview
from client import CloverqError
from scheduler.access.dev_key import DEV_KEY_FILE
from scheduler.infra.settings import Settings


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder outside any stack's data dir, as the current directory; no client env set."""
    for name in ("CLOVERQ_API_KEY", "CLOVERQ_API_URL", "CLOVERQ_DATA_DIR", "CLOVERQ_STACK_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    folder = tmp_path / "somewhere-else"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


def _stack(tmp_path: Path) -> Path:
    """A data dir as ``cloverq up`` leaves it (the dev key file)."""
    data_dir = tmp_path / "repo" / ".cloverq"
    data_dir.mkdir(parents=True)
    (data_dir / DEV_KEY_FILE).write_text("cq_dev_secret\n")
    return data_dir


def test_the_record_lives_under_xdg_state_home_and_round_trips(elsewhere: Path, tmp_path: Path) -> None:
    settings = Settings()
    path = stack_record.write_record(settings, api_url="http://127.0.0.1:8400", data_dir=_stack(tmp_path))
    assert path == tmp_path / "state" / "cloverq" / "stack.json"
    assert "cq_dev_secret" not in path.read_text()  # the secret stays in the data dir
    record = stack_record.read_record(settings)
    assert record is not None and record.api_url == "http://127.0.0.1:8400" and record.pid == os.getpid()
    stack_record.remove_record(settings)
    assert not path.exists() and stack_record.read_record(settings) is None


def test_a_record_of_a_stopped_stack_is_ignored(elsewhere: Path, tmp_path: Path) -> None:
    settings = Settings(stack_file=tmp_path / "custom.json")
    gone = '{"api_url": "http://127.0.0.1:1", "data_dir": "/x", "pid": 999999999}'
    (tmp_path / "custom.json").write_text(gone)
    assert stack_record.read_record(settings) is None
    target = resolve_target(settings)
    assert target.url == "http://127.0.0.1:8000" and target.key is None


def test_from_another_folder_the_cli_uses_the_recorded_url_and_key(elsewhere: Path, tmp_path: Path) -> None:
    data_dir = _stack(tmp_path)
    stack_record.write_record(Settings(), api_url="http://127.0.0.1:8400", data_dir=data_dir)
    target = resolve_target(Settings())
    assert (target.url, target.key) == ("http://127.0.0.1:8400", "cq_dev_secret")
    assert target.key_source == str(data_dir / DEV_KEY_FILE)


def test_the_recorded_admin_and_ops_urls_follow_the_recorded_stack_only(
    elsewhere: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cloverq up --admin-port/--ops-port` records where its planes are: `cloverq top` (admin) and
    readiness (ops) go there; a URL given instead of the record's takes neither."""
    stack_record.write_record(Settings(), api_url="http://127.0.0.1:8400", data_dir=_stack(tmp_path),
                              admin_url="http://127.0.0.1:8401", ops_url="http://127.0.0.1:8402")
    target = resolve_target(Settings())
    assert (target.admin_url, target.ops_url) == ("http://127.0.0.1:8401", "http://127.0.0.1:8402")
    other = resolve_target(Settings(), "http://127.0.0.1:9000")
    assert (other.admin_url, other.ops_url) == (None, None)
    monkeypatch.setenv("CLOVERQ_ADMIN_API_URL", "http://127.0.0.1:9101")
    assert resolve_target(Settings(), "http://127.0.0.1:9000").admin_url == "http://127.0.0.1:9101"


def test_what_is_given_wins_over_the_record(
    elsewhere: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack_record.write_record(Settings(), api_url="http://127.0.0.1:8400", data_dir=_stack(tmp_path))
    monkeypatch.setenv("CLOVERQ_API_URL", "http://127.0.0.1:9001")
    monkeypatch.setenv("CLOVERQ_API_KEY", "cq_from_env")
    target = resolve_target(Settings())
    assert (target.url, target.key) == ("http://127.0.0.1:9001", "cq_from_env")
    assert target.key_source == "CLOVERQ_API_KEY"
    flags = resolve_target(Settings(), "http://127.0.0.1:9002", "cq_flag")
    assert (flags.url, flags.key, flags.key_source) == ("http://127.0.0.1:9002", "cq_flag", "--key")


def test_an_explicit_data_dir_without_a_key_does_not_borrow_the_records(
    elsewhere: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack_record.write_record(Settings(), api_url="http://127.0.0.1:8400", data_dir=_stack(tmp_path))
    monkeypatch.setenv("CLOVERQ_DATA_DIR", str(tmp_path / "empty"))
    assert resolve_target(Settings()).key is None


def test_a_refusal_without_a_key_says_none_was_sent_and_how_to_give_one(elsewhere: Path) -> None:
    target = resolve_target(Settings())
    message = click_error(CloverqError(401, "unauthorized", "Missing API key"), target).message
    assert "no API key was sent" in message
    assert "--key" in message and "CLOVERQ_API_KEY" in message and "cloverq up" in message


def test_top_without_a_key_says_no_key_was_sent_not_that_the_key_was_refused(elsewhere: Path) -> None:
    class Refusing:
        def overview(self) -> dict[str, Any]:
            raise CloverqError(401, "unauthorized", "Missing API key")

    with pytest.raises(click.ClickException) as raised:
        fetch_overview(Refusing(), resolve_target(Settings()))  # type: ignore[arg-type]
    assert "no API key was sent" in raised.value.message and "admin scope" in raised.value.message
    with pytest.raises(click.ClickException) as refused:
        fetch_overview(Refusing(), resolve_target(Settings(), key="cq_x"))  # type: ignore[arg-type]
    assert "the key from --key" in refused.value.message
    assert "no API key was sent" not in refused.value.message


def test_operator_commands_act_on_the_running_stacks_state(elsewhere: Path, tmp_path: Path) -> None:
    """keys, tenants, model versions and golden results from another folder: the recorded data dir
    (its SQLite, its model store) and embedded Redis, not a fresh database in the current folder;
    a data dir given wins; no running stack changes nothing."""
    plain = Settings()
    assert stack_record.stack_settings(plain) is plain  # no record
    data_dir = _stack(tmp_path)
    stack_record.write_record(Settings(embedded_redis_port=6411), api_url="http://127.0.0.1:8400",
                              data_dir=data_dir)
    moved = stack_record.stack_settings(Settings())
    assert moved.resolved_database_url == f"sqlite:///{(data_dir / 'cloverq.db').resolve()}"
    assert moved.resolved_redis_url == "redis://127.0.0.1:6411/0"
    assert moved.resolved_model_root == (data_dir / "model-store").absolute()
    given = Settings(data_dir=tmp_path / "mine")
    assert stack_record.stack_settings(given) is given
    own_redis = stack_record.stack_settings(Settings(redis_url="redis://127.0.0.1:6390/0"))
    assert own_redis.resolved_redis_url == "redis://127.0.0.1:6390/0"


def test_a_stack_on_an_external_database_needs_its_url(elsewhere: Path, tmp_path: Path) -> None:
    """``up`` on CLOVERQ_DATABASE_URL records only that it had one (the URL may hold a password): an
    operator command without the URL is refused, not run on a SQLite the stack does not use."""
    external = Settings(database_url="postgresql+psycopg://cq:secret@127.0.0.1:5432/cq")
    path = stack_record.write_record(external, api_url="http://127.0.0.1:8400", data_dir=_stack(tmp_path))
    assert "secret" not in path.read_text() and "redis_port" in path.read_text()
    with pytest.raises(click.ClickException, match="CLOVERQ_DATABASE_URL"):
        stack_record.stack_settings(Settings())
    assert stack_record.stack_settings(external).resolved_database_url == external.database.url


def test_closer_state_wins_over_the_record(elsewhere: Path, tmp_path: Path) -> None:
    """A folder whose ./.cloverq holds a database of its own (a stack run by hand here), or a
    database URL given, keeps its own state: the record never redirects it elsewhere."""
    stack_record.write_record(Settings(embedded_redis_port=6411), api_url="http://127.0.0.1:8400",
                              data_dir=_stack(tmp_path))
    (elsewhere / ".cloverq").mkdir()
    (elsewhere / ".cloverq" / "cloverq.db").write_bytes(b"")
    local = Settings()
    assert stack_record.stack_settings(local) is local
    (elsewhere / ".cloverq" / "cloverq.db").unlink()
    named = Settings(database_url="postgresql+psycopg://127.0.0.1:5432/mine")
    assert stack_record.stack_settings(named) is named


def test_the_record_names_an_external_redis_and_the_model_store(elsewhere: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """An external Redis is needed as an external database is (its URL is not recorded); a model
    root given to up is recorded (a path) and used; the state used is named on stderr."""
    data_dir = _stack(tmp_path)
    up = Settings(redis_url="redis://:pw@127.0.0.1:6390/0", model_root=tmp_path / "store")
    path = stack_record.write_record(up, api_url="http://127.0.0.1:8400", data_dir=data_dir)
    assert "pw@" not in path.read_text()
    with pytest.raises(click.ClickException, match="CLOVERQ_REDIS_URL"):
        stack_record.stack_settings(Settings())
    used = stack_record.stack_settings(Settings(redis_url="redis://127.0.0.1:6390/0"))
    assert used.resolved_model_root == (tmp_path / "store").absolute()
    assert used.resolved_database_url == f"sqlite:///{(data_dir / 'cloverq.db').resolve()}"
    assert f"(the running stack's state: {data_dir.resolve()})" in capsys.readouterr().err


def test_a_record_whose_pid_now_names_another_process_is_ignored(elsewhere: Path, tmp_path: Path) -> None:
    """A record left by a crash or a reboot: its pid may run again as something else. The record
    holds its process's start; another start is not the stack (operator commands would otherwise
    write into a dead stack's data dir)."""
    settings = Settings()
    path = stack_record.write_record(settings, api_url="http://127.0.0.1:8400", data_dir=_stack(tmp_path))
    body = json.loads(path.read_text())
    assert body["started"] == stack_record.process_start(os.getpid()) and stack_record.read_record(settings)
    if body["started"] is None:
        pytest.skip("no /proc here: the start is not recorded, the pid alone is checked")
    path.write_text(json.dumps({**body, "started": body["started"] + "0"}))  # the same pid, another start
    assert stack_record.read_record(settings) is None
    assert stack_record.stack_settings(settings) is settings
