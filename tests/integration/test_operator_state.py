"""Operator state survives a Redis restart: drains and tenant caps are committed to SQL first,
and the restore (beat's reconcile tick, the API's start-up) puts them back into an empty Redis
(``scheduler/fleet/operator_state.py``). Real Redis, real databases; no workers."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
import redis as redis_lib
from celery import Celery
from fastapi.testclient import TestClient

from api.app import create_app
from scheduler.access.admission import Admission, AdmissionRefused
from scheduler.access.api_keys import create_key
from scheduler.fleet import operator_state
from scheduler.fleet.operator_state import sql_operator_state
from scheduler.fleet.queue_drain import drained_queues
from scheduler.infra.db import get_session_factory, make_engine, session_factory
from scheduler.infra.redis_keys import DRAINED_SET, LIMITS_KEY
from scheduler.infra.settings import Settings
from worker.consumers import ConsumerState, ordered_queues

pytestmark = pytest.mark.integration

CONFIGURED = ["interactive", "standard", "bulk"]


@pytest.fixture
def client(redis_url: str) -> Iterator[redis_lib.Redis]:
    client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    client.delete(DRAINED_SET, LIMITS_KEY)
    yield client
    client.delete(DRAINED_SET, LIMITS_KEY)


def refuses_over_cap(admission: Admission, tenant: str, active: int) -> bool:
    """Whether the tenant rule refuses one more job with ``active`` jobs already counted."""
    try:
        admission.check_batch(tenant=tenant, jobs={"bulk": [f"m:{uuid.uuid4().hex}"]}, active_jobs=active)
    except AdmissionRefused as refused:
        assert refused.code == "tenant_limit"
        return True
    return False


def test_drain_and_cap_come_back_after_flush(
    fresh_db_url: str, client: redis_lib.Redis, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(database_url=fresh_db_url, tenant_max_active_jobs=100)
    tenant = f"t{uuid.uuid4().hex[:8]}"
    app = Celery("unused")  # no registered workers: nothing is broadcast
    with get_session_factory(fresh_db_url)() as session:
        # Upgrade: state set in Redis before 0008 is adopted by the first restore, not wiped.
        client.sadd(DRAINED_SET, "bulk")
        assert operator_state.restore_operator_state(session, client) is False
        assert sql_operator_state(session).drained == {"bulk"}
        operator_state.set_queue_drained(session, client, app, "bulk", drained=False, destinations=[])

        operator_state.set_queue_drained(session, client, app, "interactive", drained=True, destinations=[])
        operator_state.update_limits(session, client, {f"tenant_max_active:{tenant}": 2})
        recorded = sql_operator_state(session)
        assert recorded.drained == {"interactive"} and recorded.limits == {f"tenant_max_active:{tenant}": 2.0}

        client.flushdb()  # Redis restarted empty
        admission = Admission(client, settings)
        assert drained_queues(client) == set() and admission.tenant_cap(tenant) == 100

        assert operator_state.restore_operator_state(session, client) is True
        drained = frozenset(drained_queues(client))
        state = ConsumerState(configured=tuple(CONFIGURED), drained=drained)
        assert ordered_queues(state) == ["standard", "bulk"]
        assert admission.tenant_cap(tenant) == 2
        assert refuses_over_cap(admission, tenant, active=2)
        assert not refuses_over_cap(admission, tenant, active=1)
        assert operator_state.restore_operator_state(session, client) is False  # in line: no write

        # A snapshot older than SQL (a flag resumed since) is corrected, not kept.
        client.sadd(DRAINED_SET, "standard")
        assert operator_state.restore_operator_state(session, client) is True
        assert drained_queues(client) == {"interactive"}

        # Resume and clear remove the SQL record too: nothing comes back after the next restart.
        operator_state.set_queue_drained(session, client, app, "interactive", drained=False, destinations=[])
        operator_state.update_limits(session, client, {f"tenant_max_active:{tenant}": None})
        cleared = sql_operator_state(session)
        assert cleared.drained == set() and cleared.limits == {}
        client.flushdb()
        operator_state.restore_operator_state(session, client)
        assert drained_queues(client) == set() and admission.tenant_cap(tenant) == 100


def test_admin_api_changes_survive_flush_and_api_restart(
    make_settings: Callable[..., Settings], client: redis_lib.Redis, migrated_db: str
) -> None:
    settings = make_settings()
    tenant = f"t{uuid.uuid4().hex[:8]}"
    sessions = session_factory(make_engine(migrated_db))
    with sessions() as session:
        operator_state.restore_operator_state(session, client)  # the session DB's adoption, if due
        key = create_key(session, tenant="ops", scopes=["admin"]).key
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with TestClient(create_app(settings)) as api:
            assert api.post("/v1/admin/queues/standard/drain", headers=headers).status_code == 200
            patched = api.patch("/v1/admin/limits", headers=headers,
                                json={"tenants": {tenant: {"max_active": 3}}})
            assert patched.status_code == 200, patched.text
        client.flushdb()
        with TestClient(create_app(settings)) as api:  # start-up restores from SQL
            queues = {q["name"]: q["drained"] for q in
                      api.get("/v1/admin/queues", headers=headers).json()["items"]}
            assert queues["standard"] is True and queues["interactive"] is False
            limits = api.get("/v1/admin/limits", headers=headers).json()
            assert limits["overrides"][f"tenant_max_active:{tenant}"] == 3
            assert api.post("/v1/admin/queues/standard/resume", headers=headers).status_code == 200
            assert api.patch("/v1/admin/limits", headers=headers,
                             json={"tenants": {tenant: {"max_active": None}}}).status_code == 200
        with sessions() as session:
            state = sql_operator_state(session)
        assert "standard" not in state.drained and f"tenant_max_active:{tenant}" not in state.limits
    finally:
        with sessions() as session:
            operator_state.clear_operator_state(session, client)


def test_beat_reconcile_tick_restores_a_flushed_drain(
    fresh_db_url: str, client: redis_lib.Redis, make_settings: Callable[..., Settings],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hook in ``scheduler.maintenance.tasks.reconcile_task`` (what beat runs every few seconds)."""
    from scheduler.maintenance import tasks

    settings = make_settings(database_url=fresh_db_url)
    sessions = get_session_factory(fresh_db_url)
    with sessions() as session:
        operator_state.restore_operator_state(session, client)  # this database's adoption
        operator_state.set_queue_drained(session, client, Celery("unused"), "bulk", drained=True,
                                         destinations=[])
    client.flushdb()
    monkeypatch.setattr(tasks, "_resources", lambda: (sessions(), client, settings))
    tasks.reconcile_task()
    assert drained_queues(client) == {"bulk"}
