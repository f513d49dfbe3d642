"""Model versions in SQL (both backends), the CLI as an operator runs it, and the switch turn.

- ``scheduler.model_versions.registry`` on SQLite and PostgreSQL: register, activate, roll back, the
  first start's ``ensure_active``, unknown versions refused;
- ``cloverq model versions / activate / rollback`` in a subprocess against a real store: a
  version published by ``pull`` is registered when activated; rollback copies nothing;
- ``SwitchTurn`` on real Redis: one worker of a model switches at a time; a dead holder's turn
  is taken over.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis as redis_lib
from click.testing import CliRunner, Result

from cli.main import cli
from scheduler.infra import redis_keys
from scheduler.infra.db import get_session_factory
from scheduler.infra.settings import Settings, get_settings
from scheduler.model_versions.registry import (
    UnknownModelVersion,
    activate,
    active_version,
    ensure_active,
    list_registered,
    register_version,
)
from tests.conftest import REPO_ROOT
from worker import model_store
from worker.model.demo import write_demo_checkpoint
from worker.model_switch_protocol import SwitchTurn, turn_key

pytestmark = pytest.mark.integration


def test_register_activate_roll_back_on_each_backend(db_backend_url: str) -> None:
    name = f"m-{os.urandom(3).hex()}"
    sessions = get_session_factory(db_backend_url)
    with sessions() as session:
        first = ensure_active(session, name=name, version="v1", path=f"/store/{name}/v1")
        assert (first.version, first.generation, first.previous_version) == ("v1", 1, None)
        # A second worker starting with another initial version does not override the first.
        assert ensure_active(session, name=name, version="v2", path=f"/store/{name}/v2").version == "v1"
        assert register_version(session, name=name, version="v2", path="elsewhere") is False  # idempotent
        switched = activate(session, name=name, version="v2", actor="test")
        assert (switched.version, switched.previous_version, switched.generation) == ("v2", "v1", 2)
        assert activate(session, name=name, version="v2").generation == 2  # already active: no change
        back = activate(session, name=name, version=switched.previous_version or "")
        assert (back.version, back.previous_version, back.generation) == ("v1", "v2", 3)
        with pytest.raises(UnknownModelVersion):
            activate(session, name=name, version="v9")
        rows = list_registered(session, name=name)
    assert [(r.version, r.active, r.path) for r in rows] == [
        ("v1", True, f"/store/{name}/v1"), ("v2", False, f"/store/{name}/v2"),
    ]
    with get_session_factory(db_backend_url)() as session:
        current = active_version(session, name=name)
    assert current is not None and current.version == "v1"


class Cli:
    """``cloverq model ...`` in this process (click's runner) with ``settings`` as its environment.

    In-process because every subprocess pays the torch import; one call goes through
    ``python -m cli`` to prove the command is wired into the real entry point.
    """

    def __init__(self, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
        self.env = settings.to_env()
        for key, value in self.env.items():
            monkeypatch.setenv(key, value)
        get_settings.cache_clear()  # the CLI reads settings through the process-wide cache

    def __call__(self, *args: str) -> Result:
        get_settings.cache_clear()
        return CliRunner().invoke(cli, ["model", *args])

    def subprocess(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cli", "model", *args], cwd=REPO_ROOT,
                              env={**os.environ, **self.env}, capture_output=True, text=True, timeout=120)


def test_cli_activate_rollback_and_versions(
    make_settings: Callable[..., Settings], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    root = tmp_path / "store"
    src = write_demo_checkpoint(tmp_path / "src", seed=0, size="tiny")
    for version in ("r1", "r2"):
        model_store.pull(src, name="clitest", version=version, root=root)
    weights = {p: p.stat().st_ino for p in root.rglob("*.safetensors")}
    cloverq = Cli(make_settings(model_root=root), monkeypatch)
    request.addfinalizer(get_settings.cache_clear)  # later tests must not see these settings

    listed = cloverq("versions", "clitest", "--json")
    assert listed.exit_code == 0, listed.output
    first_rows = json.loads(listed.stdout)
    assert [(r["version"], r["registered"], r["in_store"], r["active"]) for r in first_rows] == [
        ("r1", False, True, False), ("r2", False, True, False),
    ]
    first = cloverq.subprocess("activate", "clitest", "r1")  # the real entry point
    assert first.returncode == 0 and "active version r1" in first.stdout, first.stderr
    done = cloverq("activate", "clitest", "r2")
    assert done.exit_code == 0 and "active version r2 (previous: r1)" in done.stdout, done.output
    rolled = cloverq("rollback", "clitest")
    assert rolled.exit_code == 0 and "active version r1 (previous: r2)" in rolled.stdout, rolled.output
    missing = cloverq("activate", "clitest", "r9")
    assert missing.exit_code == 1 and "no registered version 'r9'" in missing.output

    rows = json.loads(cloverq("versions", "clitest", "--json").stdout)
    assert [(r["version"], r["registered"], r["active"], r["previous"]) for r in rows] == [
        ("r1", True, True, False), ("r2", True, False, True),
    ]
    assert {p: p.stat().st_ino for p in root.rglob("*.safetensors")} == weights  # nothing copied
    assert sorted(p.name for p in root.iterdir()) == ["clitest"]  # no temporary or copied folders


def test_switch_turn_one_worker_at_a_time(redis_url: str) -> None:
    client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    name = f"turn-{os.urandom(3).hex()}"
    first = SwitchTurn(client, model_name=name, worker_id="w-first")
    second = SwitchTurn(client, model_name=name, worker_id="w-second")
    client.set(redis_keys.worker("w-first"), "alive")
    try:
        assert first.take() and first.take()  # re-entrant for its holder
        assert not second.take()  # the holder is alive: wait
        first.release()
        assert second.take()
        second.release()
        assert client.get(turn_key(name)) is None

        assert first.take()
        client.delete(redis_keys.worker("w-first"))  # the holder died mid-switch
        assert second.take() and client.get(turn_key(name)) == "w-second"
        first.release()  # a stale holder cannot release someone else's turn
        assert client.get(turn_key(name)) == "w-second"
    finally:
        client.delete(turn_key(name), redis_keys.worker("w-first"))


