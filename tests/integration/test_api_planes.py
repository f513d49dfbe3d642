"""``cloverq api`` with its planes split (a port each), their allow-lists, the trusted-proxy rule and
TLS with mutual TLS on the admin plane: the real command in a subprocess, real sockets, clients
bound to other loopback addresses (127.0.0.2, 127.0.0.3, ...) to stand for other networks."""

from __future__ import annotations

import socket
import ssl
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import sessionmaker

from scheduler.access.api_keys import create_key
from scheduler.infra.db import make_engine
from scheduler.infra.settings import Settings
from tests.conftest import ProcessLauncher, ServiceProcess, free_port, wait_for

ADMIN_PATHS = ("/v1/admin/workers", "/v1/admin/overview", "/dashboard")
OPS_PATHS = ("/metrics", "/livez", "/healthz", "/readyz")


@contextmanager
def client_from(address: str, **kwargs: Any) -> Iterator[httpx.Client]:
    """A client whose connections leave from ``address`` (a loopback address: "another network")."""
    verify = kwargs.pop("verify", True)
    cert = kwargs.pop("cert", None)
    if isinstance(verify, str):
        context = ssl.create_default_context(cafile=verify)
        if cert is not None:
            context.load_cert_chain(*cert)
        verify = context
    transport = httpx.HTTPTransport(local_address=address, verify=verify, retries=0)
    with httpx.Client(transport=transport, timeout=10.0, **kwargs) as client:
        yield client


def start_api(launcher: ProcessLauncher, settings: Settings) -> tuple[ServiceProcess, dict[str, str]]:
    """``cloverq api`` with three listeners on free ports; returns the process and each plane's URL."""
    ports = {"public": free_port(), "admin": free_port(), "ops": free_port()}
    scheme = "https" if settings.planes.tls_cert_file is not None else "http"
    argv = [sys.executable, "-m", "cli", "api", "--port", str(ports["public"]),
            "--admin-port", str(ports["admin"]), "--ops-port", str(ports["ops"])]
    service = launcher._spawn(argv, settings, "api")
    urls = {name: f"{scheme}://127.0.0.1:{port}" for name, port in ports.items()}

    def listening() -> bool:
        if service.proc.poll() is not None:
            pytest.fail(f"cloverq api exited with {service.proc.returncode}:\n{service.log()[-3000:]}")
        return all(_accepts(port) for port in ports.values())

    wait_for(listening, timeout=60, message="the API's three listeners")
    return service, urls


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.fixture
def admin_key(make_settings: Callable[..., Settings]) -> str:
    settings = make_settings()
    with sessionmaker(make_engine(settings.resolved_database_url))() as session:
        return create_key(session, tenant="ops-team", scopes=["admin"]).key


def test_split_planes_serve_each_path_on_its_own_listener_only(
        launcher: ProcessLauncher, make_settings: Callable[..., Settings], admin_key: str) -> None:
    _, urls = start_api(launcher, make_settings())
    auth = {"Authorization": f"Bearer {admin_key}"}
    with client_from("127.0.0.1", headers=auth) as client:
        for path in (*ADMIN_PATHS, *OPS_PATHS):  # not even a 401: the public port has no such path
            answer = client.get(urls["public"] + path)
            assert answer.status_code == 404, path
            assert answer.json()["error"]["code"] == "not_found"
        assert client.get(urls["public"] + "/openapi.json").status_code == 200
        assert client.get(urls["public"] + "/v1/jobs/no-such-job").json()["error"]["code"] == "job_not_found"

        assert client.get(urls["admin"] + "/v1/admin/workers").status_code == 200
        assert client.get(urls["admin"] + "/dashboard").status_code == 200
        for path in ("/v1/jobs", "/metrics", "/openapi.json"):
            assert client.get(urls["admin"] + path).status_code == 404, path

        assert client.get(urls["ops"] + "/livez").json() == {"status": "ok"}
        assert "cloverq_http_requests_total" in client.get(urls["ops"] + "/metrics").text
        assert client.get(urls["ops"] + "/readyz").status_code in (200, 503)  # no worker: 503 is right
        for path in ("/v1/jobs", "/v1/admin/workers"):
            assert client.get(urls["ops"] + path).status_code == 404, path


def test_allow_lists_per_plane_and_the_trusted_proxy_rule(
        launcher: ProcessLauncher, make_settings: Callable[..., Settings], admin_key: str) -> None:
    settings = make_settings(public_allowed_networks="127.0.0.5/32",
                             admin_allowed_networks="127.0.0.1/32",
                             ops_allowed_networks="127.0.0.2/32",
                             trusted_proxies="127.0.0.4/32", log_level="INFO")  # INFO: the audit lines
    service, urls = start_api(launcher, settings)

    def refused(answer: httpx.Response, address: str) -> bool:
        error = answer.json()["error"]
        return (answer.status_code == 403 and error["code"] == "network_not_allowed"
                and error["details"]["client_address"] == address)

    with client_from("127.0.0.2") as ops_network, client_from("127.0.0.3") as elsewhere:
        assert ops_network.get(urls["ops"] + "/livez").status_code == 200
        assert refused(elsewhere.get(urls["ops"] + "/livez"), "127.0.0.3")
        assert refused(elsewhere.get(urls["admin"] + "/v1/admin/workers"), "127.0.0.3")
    with client_from("127.0.0.1", headers={"Authorization": f"Bearer {admin_key}"}) as admin_network:
        assert admin_network.get(urls["admin"] + "/v1/admin/workers").status_code == 200

    public = urls["public"] + "/openapi.json"
    with client_from("127.0.0.5") as allowed_client, client_from("127.0.0.6") as other:
        assert allowed_client.get(public).status_code == 200
        assert refused(other.get(public), "127.0.0.6")
        # A spoofed header from a peer that is no trusted proxy changes nothing.
        assert refused(other.get(public, headers={"X-Forwarded-For": "127.0.0.5"}), "127.0.0.6")
        assert refused(other.get(public, headers={"Forwarded": "for=127.0.0.5"}), "127.0.0.6")
    with client_from("127.0.0.4") as proxy:  # the trusted proxy, forwarding for its clients
        assert proxy.get(public, headers={"X-Forwarded-For": "127.0.0.5"}).status_code == 200
        assert proxy.get(public, headers={"Forwarded": 'for="127.0.0.5:5555";proto=https'}).status_code == 200
        # The caller wrote the left-most entry; the proxy appended the real address: that one counts.
        assert refused(proxy.get(public, headers={"X-Forwarded-For": "127.0.0.5, 127.0.0.6"}), "127.0.0.6")
        assert refused(proxy.get(public), "127.0.0.4")  # no header: the proxy itself is the caller

    with client_from("127.0.0.2") as ops_network:
        metrics = ops_network.get(urls["ops"] + "/metrics").text
    assert 'cloverq_network_refusals_total{plane="public",reason="plane"} 5.0' in metrics
    assert 'cloverq_network_refusals_total{plane="ops",reason="plane"} 1.0' in metrics
    assert 'cloverq_network_refusals_total{plane="admin",reason="plane"} 1.0' in metrics
    audit_lines = [line for line in service.log().splitlines() if '"audit.network.refused"' in line]
    assert len(audit_lines) == 7 and any('"client_address": "127.0.0.6"' in line for line in audit_lines)


def test_api_over_tls_with_client_certificates_on_the_admin_plane(
        launcher: ProcessLauncher, make_settings: Callable[..., Settings], pki: Any, admin_key: str) -> None:
    settings = make_settings(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
                             admin_tls_client_ca_file=pki.ca_cert)
    _, urls = start_api(launcher, settings)
    ca = str(pki.ca_cert)
    auth = {"Authorization": f"Bearer {admin_key}"}
    with client_from("127.0.0.1", verify=ca) as client:
        assert client.get(urls["public"] + "/openapi.json").status_code == 200
        assert client.get(urls["ops"] + "/livez").status_code == 200
        with pytest.raises(httpx.TransportError):  # no client certificate: refused in the handshake
            client.get(urls["admin"] + "/v1/admin/workers", headers=auth)
    wrong_ca = str(pki.other_ca_cert)
    with client_from("127.0.0.1", verify=wrong_ca) as distrustful, pytest.raises(httpx.ConnectError):
        distrustful.get(urls["public"] + "/openapi.json")
    with client_from("127.0.0.1") as plain, pytest.raises(httpx.TransportError):
        plain.get(urls["public"].replace("https://", "http://") + "/openapi.json")
    with client_from("127.0.0.1", verify=ca, cert=(str(pki.client_cert), str(pki.client_key))) as mutual:
        assert mutual.get(urls["admin"] + "/v1/admin/workers", headers=auth).status_code == 200
