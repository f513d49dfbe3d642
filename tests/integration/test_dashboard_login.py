"""The dashboard's one-time sign-in link (``api/dashboard_login.py``) on a real Redis: a code
works once, then (or once expired, or made up) it is a 401 that says what to do instead."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient

from api.app import create_app
from api.dashboard_login import issue_login_code
from scheduler.infra.settings import Settings

pytestmark = pytest.mark.integration


def test_a_login_code_is_traded_for_its_key_once(
    make_settings: Callable[..., Settings], demo_checkpoint: Path, redis_url: str
) -> None:
    settings = make_settings(model_dir=demo_checkpoint)
    code = issue_login_code(redis_lib.Redis.from_url(redis_url), "cq_the_dev_key")
    with TestClient(create_app(settings)) as client:
        first = client.post("/dashboard/login", json={"code": code})
        assert first.status_code == 200 and first.json() == {"key": "cq_the_dev_key"}
        again = client.post("/dashboard/login", json={"code": code})
        assert again.status_code == 401 and again.json()["error"]["code"] == "unauthorized"
        assert "already used or has expired" in again.json()["error"]["message"]
        assert "cq_the_dev_key" not in again.text
        assert client.post("/dashboard/login", json={"code": "x"}).status_code == 422
        # Expiry is Redis's own (SET EX): a code whose entry is gone answers as a used one.
        store = redis_lib.Redis.from_url(redis_url)
        gone = issue_login_code(store, "cq_k", ttl=600)
        store.delete(*store.keys("cloverq:dashboard-login:*"))
        assert client.post("/dashboard/login", json={"code": gone}).status_code == 401
