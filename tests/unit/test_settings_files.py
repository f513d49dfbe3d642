"""Any setting can come from a file (``CLOVERQ_<NAME>_FILE``: Kubernetes and Docker secret mounts)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic_settings import SettingsError

from cli.services import _child_env
from scheduler.infra.settings import Settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("CLOVERQ_"):
            monkeypatch.delenv(key)


def secret(tmp_path: Path, name: str, content: str) -> Path:
    path = tmp_path / name
    path.write_text(content)
    path.chmod(0o600)
    return path


def test_a_setting_is_read_from_its_file_without_the_trailing_newline(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    url = "postgresql+psycopg://cloverq:s3cr%40t@db:5432/cloverq?sslmode=verify-full&sslrootcert=/ca.pem"
    monkeypatch.setenv("CLOVERQ_DATABASE_URL_FILE", str(secret(tmp_path, "db", url + "\n")))
    monkeypatch.setenv("CLOVERQ_REDIS_URL_FILE", str(secret(tmp_path, "redis", "rediss://:pw@r:6380/0\r\n")))
    monkeypatch.setenv("CLOVERQ_ENGINE_MAX_BATCH_FILE", str(secret(tmp_path, "batch", "6\n")))
    monkeypatch.setenv("CLOVERQ_QUEUE_MAX_DEPTH_FILE", str(secret(tmp_path, "depth", '{"bulk": 3}')))
    settings = Settings()
    assert settings.database.url == url
    assert settings.redis.url == "rediss://:pw@r:6380/0"
    assert settings.engine.max_batch == 6  # parsed like the variable itself
    assert settings.admission.queue_max_depth == {"bulk": 3}


def test_a_value_given_twice_is_an_error_that_shows_no_value(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CLOVERQ_REDIS_URL", "redis://:first-secret@r/0")
    monkeypatch.setenv("CLOVERQ_REDIS_URL_FILE", str(secret(tmp_path, "redis", "redis://:second-secret@r/0")))
    both = "both CLOVERQ_REDIS_URL and CLOVERQ_REDIS_URL_FILE are set"
    with pytest.raises(SettingsError, match=both) as err:
        Settings()
    assert "secret" not in str(err.value).replace("CLOVERQ_", "")


def test_an_unreadable_or_empty_file_variable_is_a_clear_error(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CLOVERQ_DATABASE_URL_FILE", str(tmp_path / "missing"))
    with pytest.raises(SettingsError, match=r"CLOVERQ_DATABASE_URL_FILE=.*/missing: cannot read the file "
                                            r"\(No such file or directory\)"):
        Settings()
    monkeypatch.setenv("CLOVERQ_DATABASE_URL_FILE", "")
    with pytest.raises(SettingsError, match="CLOVERQ_DATABASE_URL_FILE is empty"):
        Settings()


def test_a_setting_named_like_a_file_variable_stays_that_setting(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # CLOVERQ_STACK_FILE is client.stack_file itself, not "stack" from a file.
    monkeypatch.setenv("CLOVERQ_STACK_FILE", str(tmp_path / "stack.json"))
    assert Settings().client.stack_file == tmp_path / "stack.json"


def test_up_children_read_the_same_secret_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``cloverq up`` pins the Redis URL for its children: given by a file, the children read the
    file too (never both variables, never the secret in their environment)."""
    path = secret(tmp_path, "redis", "redis://:pw@127.0.0.1:7000/0\n")
    monkeypatch.setenv("CLOVERQ_REDIS_URL_FILE", str(path))
    env = _child_env(Settings(), tmp_path)
    assert env["CLOVERQ_REDIS_URL_FILE"] == str(path)
    assert "CLOVERQ_REDIS_URL" not in env
    # A pinned value that differs from the file's (data_dir made absolute) replaces the file variable.
    monkeypatch.setenv("CLOVERQ_DATA_DIR_FILE", str(secret(tmp_path, "data", "relative-dir\n")))
    env = _child_env(Settings(), tmp_path)
    assert env["CLOVERQ_DATA_DIR"] == str(tmp_path) and "CLOVERQ_DATA_DIR_FILE" not in env


def test_secret_urls_from_files_are_masked_wherever_they_are_shown(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from scheduler.infra.db import redact_url
    from scheduler.observability.redaction import redact_text

    monkeypatch.setenv("CLOVERQ_REDIS_URL_FILE", str(secret(
        tmp_path, "redis", "rediss://:r3dis-pw@r:6380/0?ssl_ca_certs=/etc/cloverq/ca.pem\n")))
    monkeypatch.setenv("CLOVERQ_DATABASE_URL_FILE", str(secret(
        tmp_path, "db", "postgresql+psycopg://cloverq:db-pw@db/cloverq?sslmode=verify-full&sslrootcert=/ca.pem")))
    settings = Settings()
    logged = redact_text(f"broker {settings.resolved_redis_url} database {settings.resolved_database_url}")
    assert "r3dis-pw" not in logged and "db-pw" not in logged
    assert "ssl_ca_certs=/etc/cloverq/ca.pem" in logged  # the rest stays readable
    assert "db-pw" not in redact_url(settings.resolved_database_url)  # cloverq up / migrate print this
