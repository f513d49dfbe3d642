"""API keys on a real server (uvicorn, the session database and Redis) (issue 28, "Must show"):
per-key networks, rotation with overlap, last use, and ``cloverq keys`` in process (CliRunner).

Clients bind source addresses of their own on loopback (127.0.0.2, 127.0.0.3: "other networks"),
so the address the API sees is the socket's, as in production.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result
from sqlalchemy import update

from scheduler.access.api_keys import ALL_SCOPES, ApiKey, create_key, list_keys
from scheduler.infra.db import make_engine, session_factory
from scheduler.infra.settings import Settings, get_settings
from scheduler.observability import audit as audit_module
from scheduler.observability.process_metrics import PROCESS_REGISTRY
from tests.integration.api_server import ApiServer

pytestmark = pytest.mark.integration


class Audits:
    """Records the audit lines (``scheduler.observability.audit``) written while a test runs."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append({"event": event, **fields})

    def of(self, action: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line["action"] == action]


@pytest.fixture
def audits(monkeypatch: pytest.MonkeyPatch) -> Audits:
    recorder = Audits()
    monkeypatch.setattr(audit_module, "_log", recorder)
    return recorder


@pytest.fixture(scope="module")
def server(make_settings: Callable[..., Settings]) -> Iterator[ApiServer]:
    api = ApiServer(make_settings()).start()
    yield api
    api.stop()


def tenant_name() -> str:
    return f"k{uuid.uuid4().hex[:10]}"


class Api:
    """Clients of the server from chosen loopback addresses, with an admin key."""

    def __init__(self, server: ApiServer, settings_url: str) -> None:
        self.server = server
        self.sessions = session_factory(make_engine(settings_url))
        with self.sessions() as session:
            self.admin = create_key(session, tenant=tenant_name(), scopes=ALL_SCOPES).key
        self._clients: dict[str, httpx.Client] = {}

    def client(self, address: str = "127.0.0.1") -> httpx.Client:
        if address not in self._clients:
            self._clients[address] = httpx.Client(
                base_url=self.server.url, timeout=30,
                transport=httpx.HTTPTransport(local_address=address))
        return self._clients[address]

    def get_jobs(self, key: str, address: str) -> httpx.Response:
        return self.client(address).get("/v1/jobs", headers={"Authorization": f"Bearer {key}"})

    def admin_call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self.client().request(method, f"/v1/admin{path}",
                                     headers={"Authorization": f"Bearer {self.admin}"}, **kwargs)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()


@pytest.fixture
def api(server: ApiServer, migrated_db: str) -> Iterator[Api]:
    instance = Api(server, migrated_db)
    yield instance
    instance.close()


def error_of(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code
    return error


def refusals() -> float:
    value = PROCESS_REGISTRY.get_sample_value("cloverq_network_refusals_total",
                                              {"plane": "public", "reason": "key"})
    return value or 0.0


def test_a_key_works_only_from_its_networks_which_the_admin_api_changes(api: Api, audits: Audits) -> None:
    tenant = tenant_name()
    made = api.admin_call("POST", "/keys", json={"tenant": tenant, "scopes": ["read"],
                                                 "allowed_networks": ["127.0.0.2", "10.1.2.3/8"]})
    assert made.status_code == 201, made.text
    key, key_id = made.json()["key"], made.json()["key_id"]
    assert key.startswith(f"cloverq_{key_id}_")
    assert made.json()["allowed_networks"] == ["127.0.0.2/32", "10.0.0.0/8"]

    assert api.get_jobs(key, "127.0.0.2").status_code == 200
    before = refusals()
    error = error_of(api.get_jobs(key, "127.0.0.3"), 403, "network_not_allowed")
    assert error["details"] == {"client_address": "127.0.0.3"} and "127.0.0.3" in error["message"]
    assert refusals() == before + 1
    [refused] = audits.of("network.refused")
    assert (refused["actor_key_id"], refused["client_address"], refused["reason"]) == \
        (key_id, "127.0.0.3", "key")

    # Bad networks are 422 JSON errors; an unknown key 404.
    for bad in (["10.0.0.0/33"], ["not-a-network"], [""]):
        error_of(api.admin_call("POST", "/keys", json={"tenant": tenant, "allowed_networks": bad}),
                 422, "invalid_request")
        error_of(api.admin_call("PATCH", f"/keys/{key_id}", json={"allowed_networks": bad}),
                 422, "invalid_request")
    error_of(api.admin_call("PATCH", "/keys/000000000000", json={"allowed_networks": []}),
             404, "key_not_found")

    changed = api.admin_call("PATCH", f"/keys/{key_id}", json={"allowed_networks": ["127.0.0.3/32"]})
    assert changed.status_code == 200 and changed.json()["allowed_networks"] == ["127.0.0.3/32"]
    assert api.get_jobs(key, "127.0.0.3").status_code == 200  # this process applies it at once
    error_of(api.get_jobs(key, "127.0.0.2"), 403, "network_not_allowed")
    assert [line["allowed_networks"] for line in audits.of("key.set_networks")] == [["127.0.0.3/32"]]
    cleared = api.admin_call("PATCH", f"/keys/{key_id}", json={"allowed_networks": None})
    assert cleared.status_code == 200 and cleared.json()["allowed_networks"] == []
    assert api.get_jobs(key, "127.0.0.2").status_code == 200

    # The last use (time and address) is kept in memory and written in the background.
    api.server.app.state.security.authenticator.flush_last_used()
    [listed] = api.admin_call("GET", "/keys", params={"tenant": tenant}).json()["items"]
    assert listed["last_used_address"] == "127.0.0.2" and listed["last_used_at"] is not None
    assert listed["state"] == "active" and listed["expires_at"] is None


def test_rotation_both_keys_work_during_the_overlap_then_only_the_successor(api: Api, audits: Audits) -> None:
    with api.sessions() as session:
        old = create_key(session, tenant=tenant_name(), scopes=["read"], label="svc",
                         allowed_networks=["127.0.0.0/8"])
    old_id = old.info.key_id
    assert api.get_jobs(old.key, "127.0.0.2").status_code == 200  # cached in the server from here on
    for overlap in (-1, 30 * 86400 + 1):
        error_of(api.admin_call("POST", f"/keys/{old_id}/rotate", json={"overlap_seconds": overlap}),
                 422, "invalid_request")
    error_of(api.admin_call("POST", "/keys/000000000000/rotate", json={"overlap_seconds": 1}),
             404, "key_not_found")

    rotated = api.admin_call("POST", f"/keys/{old_id}/rotate", json={"overlap_seconds": 2})
    assert rotated.status_code == 201, rotated.text
    body = rotated.json()
    new_key, new_id = body["key"], body["key_id"]
    assert new_key.startswith("cloverq_") and body["rotated_from"] == old_id
    assert (body["label"], body["scopes"], body["allowed_networks"]) == ("svc", ["read"], ["127.0.0.0/8"])
    assert body["previous"]["key_id"] == old_id and body["previous"]["state"] == "rotating"
    expires_at = datetime.fromisoformat(body["previous"]["expires_at"])

    assert api.get_jobs(old.key, "127.0.0.2").status_code == 200  # the overlap
    assert api.get_jobs(new_key, "127.0.0.2").status_code == 200
    error = error_of(api.admin_call("POST", f"/keys/{old_id}/rotate", json={}), 409, "key_not_rotatable")
    assert error["details"]["reason"].startswith("rotated already")

    time.sleep(max(0.0, expires_at.timestamp() - time.time()) + 0.05)
    # Still within the server's key cache time: the expiry is checked on every use.
    error = error_of(api.get_jobs(old.key, "127.0.0.2"), 401, "unauthorized")
    assert "expired" in error["message"] and "rotated" in error["message"]
    assert api.get_jobs(new_key, "127.0.0.2").status_code == 200
    error = error_of(api.admin_call("POST", f"/keys/{old_id}/rotate", json={"overlap_seconds": 0}),
                     409, "key_not_rotatable")
    assert error["details"]["reason"] == "expired"

    [line] = audits.of("key.rotate")
    assert (line["previous_key_id"], line["new_key_id"], line["overlap_seconds"]) == (old_id, new_id, 2)
    assert line["actor_key_id"] == api.admin.split("_")[1] and new_key not in str(audits.lines)
    items = {item["key_id"]: item for item in api.admin_call("GET", "/keys").json()["items"]}
    assert items[old_id]["state"] == "expired" and items[new_id]["rotated_from"] == old_id


def test_rotation_without_a_body_keeps_the_default_overlap_of_a_day(api: Api) -> None:
    """As ``cloverq keys rotate KEY_ID``: no body is the default overlap, not a 422."""
    with api.sessions() as session:
        old = create_key(session, tenant=tenant_name(), scopes=["read"])
    rotated = api.admin_call("POST", f"/keys/{old.info.key_id}/rotate")
    assert rotated.status_code == 201, rotated.text
    ends = datetime.fromisoformat(rotated.json()["previous"]["expires_at"]).timestamp() - time.time()
    assert 86000 < ends <= 86400


def test_rotation_without_overlap_ends_the_key_at_once(api: Api) -> None:
    with api.sessions() as session:
        old = create_key(session, tenant=tenant_name(), scopes=["read"])
    assert api.get_jobs(old.key, "127.0.0.1").status_code == 200
    rotated = api.admin_call("POST", f"/keys/{old.info.key_id}/rotate", json={"overlap_seconds": 0})
    assert rotated.status_code == 201 and rotated.json()["previous"]["state"] == "revoked", rotated.text
    error_of(api.get_jobs(old.key, "127.0.0.1"), 401, "unauthorized")
    assert api.get_jobs(rotated.json()["key"], "127.0.0.1").status_code == 200


# --- the CLI ------------------------------------------------------------------------------------


@pytest.fixture
def keys_cli(make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch,
             request: pytest.FixtureRequest) -> Callable[..., Result]:
    from cli.main import cli

    for name, value in make_settings().to_env().items():
        monkeypatch.setenv(name, value)
    request.addfinalizer(get_settings.cache_clear)  # later tests must not see these settings

    def run(*args: str) -> Result:
        get_settings.cache_clear()
        return CliRunner().invoke(cli, ["keys", *args])

    return run


def test_keys_cli_networks_rotate_and_list(keys_cli: Callable[..., Result], audits: Audits,
                                           migrated_db: str) -> None:
    tenant = tenant_name()
    bad = keys_cli("create", "--tenant", tenant, "--allowed-network", "10.0.0.0/33")
    assert bad.exit_code == 2 and "invalid network" in bad.output, bad.output
    created = keys_cli("create", "--tenant", tenant, "--allowed-network", "10.0.0.0/8",
                       "--allowed-network", "127.0.0.2/32")
    assert created.exit_code == 0, created.output
    key = created.output.strip().splitlines()[-1]
    key_id = key.split("_")[1]
    assert key.startswith("cloverq_") and "networks: 10.0.0.0/8,127.0.0.2/32" in created.output

    assert keys_cli("set-networks", key_id).exit_code == 2  # --network or --any
    assert keys_cli("set-networks", key_id, "--network", "300.0.0.1").exit_code == 2
    changed = keys_cli("set-networks", key, "--network", "127.0.0.3")  # a whole key names its id
    assert changed.exit_code == 0 and "127.0.0.3/32" in changed.output, changed.output

    assert keys_cli("rotate", key_id, "--overlap", "31d").exit_code == 2
    assert keys_cli("rotate", key_id, "--overlap", "soon").exit_code == 2
    rotated = keys_cli("rotate", key_id, "--overlap", "24h")
    assert rotated.exit_code == 0, rotated.output
    new_key = rotated.output.strip().splitlines()[-1]
    assert new_key.startswith("cloverq_") and new_key != key and "the old key ends at" in rotated.output
    again = keys_cli("rotate", key_id)
    assert again.exit_code == 1 and "rotated already" in again.output

    new_id = new_key.split("_")[1]
    listed = keys_cli("list", "--tenant", tenant)
    assert listed.exit_code == 0 and key not in listed.output and new_key not in listed.output
    rows = {line.split()[0]: line for line in listed.output.splitlines()[1:]}
    assert "rotating" in rows[key_id] and "127.0.0.3/32" in rows[key_id]
    assert key_id in rows[new_id] and "127.0.0.3/32" in rows[new_id] and "active" in rows[new_id]
    [line] = audits.of("key.rotate")
    assert (line["via"], line["previous_key_id"], line["new_key_id"], line["overlap_seconds"]) == \
        ("cli", key_id, new_id, 86400)
    with session_factory(make_engine(migrated_db))() as session:
        [old] = [info for info in list_keys(session, tenant=tenant) if info.key_id == key_id]
    assert old.expires_at is not None and 86000 < old.expires_at.timestamp() - time.time() <= 86400

    with session_factory(make_engine(migrated_db))() as session:  # the overlap runs out
        session.execute(update(ApiKey).where(ApiKey.key_id == key_id)
                        .values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
        session.commit()
    everything = keys_cli("list", "--tenant", tenant).output
    working = keys_cli("list", "--tenant", tenant, "--active").output
    assert "expired" in {line.split()[0]: line for line in everything.splitlines()[1:]}[key_id]
    assert {line.split()[0] for line in working.splitlines()[1:]} == {new_id}  # expired: not listed
