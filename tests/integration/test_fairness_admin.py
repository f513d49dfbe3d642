"""Fair-share weights over the admin API and the CLI, and what the dashboard and /metrics show.

Real API (TestClient), real Redis and SQL; no worker, so a batch over the window stays held.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis as redis_lib
from click.testing import CliRunner
from fastapi.testclient import TestClient

from api.app import create_app
from cli.main import cli
from scheduler.access.api_keys import create_key
from scheduler.fleet.operator_state import clear_operator_state, restore_operator_state
from scheduler.infra.db import get_session_factory
from scheduler.infra.redis_keys import LIMITS_KEY
from scheduler.infra.settings import Settings
from tests.conftest import clear_leftover_jobs

pytestmark = pytest.mark.integration

WINDOW = 4


@pytest.fixture
def api(make_settings: Callable[..., Settings]) -> Iterator[tuple[Settings, TestClient, dict[str, str]]]:
    settings = make_settings(fair_share_window=WINDOW, tenant_max_active_jobs=10_000)
    clear_leftover_jobs(settings)
    sessions = get_session_factory(settings.resolved_database_url)
    with sessions() as session:
        clear_operator_state(session, redis_lib.Redis.from_url(settings.resolved_redis_url))
        admin = create_key(session, tenant="ops", scopes=("admin",)).key
    with TestClient(create_app(settings)) as client:
        yield settings, client, {"Authorization": f"Bearer {admin}"}
    with sessions() as session:
        clear_operator_state(session, redis_lib.Redis.from_url(settings.resolved_redis_url))
    clear_leftover_jobs(settings)


def test_a_weight_is_set_shown_and_survives_a_redis_flush(api: tuple[Settings, TestClient, Any]) -> None:
    settings, client, admin = api
    tenant = f"t{uuid.uuid4().hex[:8]}"
    response = client.put(f"/v1/admin/tenants/{tenant}/weight", json={"weight": 3}, headers=admin)
    assert response.status_code == 200, response.text
    assert response.json() == {"tenant": tenant, "weight": 3.0, "overridden": True, "default": 1.0}
    assert client.get("/v1/admin/limits", headers=admin).json()["overrides"][f"fair_weight:{tenant}"] == 3
    redis = redis_lib.Redis.from_url(settings.resolved_redis_url)
    redis.delete(LIMITS_KEY)  # Redis restarted empty: the reconcile tick restores it from SQL
    with get_session_factory(settings.resolved_database_url)() as session:
        restore_operator_state(session, redis)
    assert float(redis.hget(LIMITS_KEY, f"fair_weight:{tenant}") or 0) == 3.0
    patched = client.patch("/v1/admin/limits", json={"tenants": {tenant: {"weight": None}}}, headers=admin)
    assert patched.status_code == 200 and f"fair_weight:{tenant}" not in patched.json()["overrides"]


@pytest.mark.parametrize("body", [{"weight": 0}, {"weight": 5000}, {"weight": "x"}, {}])
def test_a_bad_weight_is_a_422_and_changes_nothing(api: tuple[Settings, TestClient, Any],
                                                   body: dict[str, Any]) -> None:
    _, client, admin = api
    response = client.put("/v1/admin/tenants/acme/weight", json=body, headers=admin)
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_request"
    assert "fair_weight:acme" not in client.get("/v1/admin/limits", headers=admin).json()["overrides"]
    bad_name = client.put("/v1/admin/tenants/bad name!/weight", json={"weight": 2}, headers=admin)
    assert bad_name.status_code == 422


def test_the_dashboard_and_metrics_show_each_tenants_held_and_queued_jobs(
    api: tuple[Settings, TestClient, Any],
) -> None:
    settings, client, admin = api
    assert client.put("/v1/admin/tenants/big/weight", json={"weight": 2}, headers=admin).status_code == 200
    with get_session_factory(settings.resolved_database_url)() as session:
        key = create_key(session, tenant="big", scopes=("submit", "read")).key
    jobs = [{"kind": "generate", "input": {"prompt": f"p{i}"}, "params": {"max_new_tokens": 4}}
            for i in range(10)]
    created = client.post("/v1/batches", json={"jobs": jobs}, headers={"Authorization": f"Bearer {key}"})
    assert created.status_code == 202, created.text
    overview = client.get("/v1/admin/overview", headers=admin).json()
    rows = [row for row in overview["tenants"] if row["tenant"] == "big"]
    assert rows == [{"queue": "bulk", "tenant": "big", "queued": 10, "running": 0, "held": 10 - WINDOW,
                     "oldest_wait_seconds": rows[0]["oldest_wait_seconds"], "weight": 2.0}]
    metrics = client.get("/metrics").text
    assert 'cloverq_tenant_queue_depth{queue="bulk",tenant="big"} 10.0' in metrics
    assert 'cloverq_tenant_oldest_wait_seconds{queue="bulk",tenant="big"}' in metrics


def test_the_cli_sets_and_lists_weights(api: tuple[Settings, TestClient, Any],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    settings, _, _ = api
    for name, value in settings.to_env().items():
        monkeypatch.setenv(name, value)
    from scheduler.infra.settings import get_settings

    get_settings.cache_clear()
    try:
        runner = CliRunner()
        assert runner.invoke(cli, ["tenants", "weight", "acme", "2.5"]).exit_code == 0
        listed = runner.invoke(cli, ["tenants", "weights"])
        assert listed.exit_code == 0 and "acme" in listed.output and "2.5" in listed.output
        assert runner.invoke(cli, ["tenants", "weight", "acme", "0"]).exit_code != 0  # out of range
        assert runner.invoke(cli, ["tenants", "weight", "acme", "--clear"]).exit_code == 0
        assert "acme" not in runner.invoke(cli, ["tenants", "weights"]).output
    finally:
        get_settings.cache_clear()
