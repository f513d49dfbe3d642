"""``cloverq keys create | list | revoke`` as a user runs them: a subprocess with the service's
settings in ``CLOVERQ_*`` variables; the created key then works against the real API."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from scheduler.infra.settings import Settings
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.integration


def cloverq(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    import os

    env = {**os.environ, **settings.to_env()}
    return subprocess.run(
        [sys.executable, "-m", "cli", "keys", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_keys_create_list_revoke_round_trip(make_settings: Callable[..., Any]) -> None:
    settings: Settings = make_settings(log_level="INFO")
    created = cloverq(
        settings, "create", "--tenant", "cli-tenant", "--scopes", "submit,read", "--label", "ci"
    )
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().splitlines()[-1]
    assert key.startswith("cloverq_") and " " not in key  # the key, alone on the last line
    key_id = key.split("_")[1]

    # Every key change leaves an audit line on stderr, naming the key id, never the secret.
    audits = [json.loads(line) for line in created.stderr.splitlines() if '"audit"' in line]
    assert [entry["action"] for entry in audits] == ["key.create"]
    assert audits[0]["target"] == key_id and key not in created.stderr

    with TestClient(create_app(settings)) as client:
        headers = {"Authorization": f"Bearer {key}"}
        assert client.get("/v1/jobs", headers=headers).status_code == 200

        listed = cloverq(settings, "list")
        assert listed.returncode == 0, listed.stderr
        row = next(line for line in listed.stdout.splitlines() if line.startswith(key_id))
        assert "cli-tenant" in row and "read,submit" in row and "active" in row
        assert key not in listed.stdout

        revoked = cloverq(settings, "revoke", key_id)
        assert revoked.returncode == 0, revoked.stderr
        assert "refuse it now" in revoked.stdout
        assert '"key.revoke"' in revoked.stderr
        response = client.get("/v1/jobs", headers=headers)  # cached in this process, yet refused
        assert response.status_code == 401 and response.json()["error"]["code"] == "unauthorized"

    listed = cloverq(settings, "list", "--active")
    assert key_id not in listed.stdout
