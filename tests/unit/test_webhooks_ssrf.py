"""Webhook targets (SSRF, issue 16): only public addresses unless an allow-list names them.

Network rule of this module: nothing here ever connects to, or even resolves, anything but
loopback. Refusals are shown with address checks and a resolver that is told what to answer
(e.g. ``10.0.0.1``); the autouse ``_loopback_only`` guard fails the test on any attempt to open
a connection to a non-loopback address or to use the system resolver for a name, and records
every connection so a test can assert that a refused delivery attempted none. Deliveries that
do go out reach HTTP servers started here on 127.0.0.1.
"""

from __future__ import annotations

import json
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from api.errors import ApiError
from api.limits import check_webhook_url
from scheduler.infra.db import get_session_factory, migrate
from scheduler.infra.settings import Settings
from scheduler.webhooks import delivery, ssrf_guard
from scheduler.webhooks.delivery import deliver_once
from scheduler.webhooks.signing import SIGNATURE_HEADER, tenant_secret, verify_signature
from scheduler.webhooks.ssrf_guard import (
    WebhookResolveError,
    WebhookTargetError,
    check_url,
    refused_reason,
    resolve_target,
)
from scheduler.webhooks.tables import DeliveryStatus, WebhookDelivery

LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass
class Guard:
    connections: list[Any] = field(default_factory=list)


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch: pytest.MonkeyPatch) -> Guard:
    """Fail on any connection to a non-loopback address and on any real name lookup."""
    guard = Guard()
    real_connect = socket.create_connection
    real_getaddrinfo = socket.getaddrinfo

    def create_connection(address: Any, *args: Any, **kwargs: Any) -> socket.socket:
        guard.connections.append(address)
        if str(address[0]) not in LOOPBACK:
            raise AssertionError(f"test tried to connect to {address!r}")
        return real_connect(address, *args, **kwargs)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if str(host) not in LOOPBACK:
            raise AssertionError(f"test tried to resolve {host!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", create_connection)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return guard


def _settings(**overrides: Any) -> Settings:
    return Settings(**overrides)


# --- address checks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"), ("127.9.9.9", "loopback"), ("::1", "loopback"),
        ("10.0.0.1", "private"), ("172.16.0.1", "private"), ("192.168.1.10", "private"),
        ("fc00::1", "private"), ("fd12:3456::1", "private"),
        ("169.254.169.254", "metadata"), ("fd00:ec2::254", "metadata"), ("100.100.100.200", "metadata"),
        ("169.254.10.1", "link-local"), ("fe80::1", "link-local"), ("fe80::1%lo", "link-local"),
        ("224.0.0.1", "multicast"), ("239.255.255.250", "multicast"), ("ff02::1", "multicast"),
        ("0.0.0.0", "unspecified"), ("::", "unspecified"),
        ("240.0.0.1", ""), ("255.255.255.255", ""), ("100.64.0.1", "public"), ("192.0.2.1", ""),
        ("198.18.0.1", ""), ("2001:db8::1", ""),
        ("::ffff:127.0.0.1", "loopback"), ("::ffff:10.0.0.1", "private"),  # IPv4-mapped
        ("::ffff:169.254.169.254", "metadata"), ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
    ],
)
def test_non_public_addresses_are_refused(address: str, reason: str) -> None:
    refused = refused_reason(address, _settings())
    assert refused is not None
    assert reason in refused


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "2002:808:808::"])
def test_public_addresses_are_allowed(address: str) -> None:
    assert refused_reason(address, _settings()) is None


def test_allowed_networks_override_the_refusal() -> None:
    settings = _settings(webhook_allowed_networks="127.0.0.0/8, 10.8.0.0/16")
    assert refused_reason("127.0.0.1", settings) is None
    assert refused_reason("::ffff:127.0.0.1", settings) is None  # judged as its IPv4 address
    assert refused_reason("10.8.3.4", settings) is None
    assert refused_reason("10.9.0.1", settings) is not None
    assert refused_reason("::1", settings) is not None
    assert refused_reason("169.254.169.254", settings) is not None


def test_allow_lists_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOVERQ_WEBHOOK_ALLOWED_NETWORKS", '["127.0.0.0/8", "::1"]')
    monkeypatch.setenv("CLOVERQ_WEBHOOK_ALLOWED_HOSTS", "Hooks.Internal., receiver.test")
    settings = Settings()
    assert settings.webhooks.allowed_networks == ["127.0.0.0/8", "::1/128"]
    assert settings.webhooks.allowed_hosts == ["hooks.internal", "receiver.test"]
    monkeypatch.setenv("CLOVERQ_WEBHOOK_ALLOWED_NETWORKS", "not-a-network")
    with pytest.raises(ValueError):
        Settings()


# --- the URL at submit (no DNS) ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("https://user:pw@hooks.example.com/x", "credentials"),
        ("https://token@hooks.example.com/x", "credentials"),
        ("http://user:p%40ss@127.0.0.1:9/x", "credentials"),
        ("ftp://hooks.example.com/x", "http or https"),
        ("http://127.0.0.1:8000/hook", "loopback"),
        ("http://[::1]:8000/hook", "loopback"),
        ("http://[::ffff:127.0.0.1]/hook", "loopback"),
        ("http://localhost:8000/hook", "loopback"),
        ("http://LOCALHOST./hook", "loopback"),
        ("http://api.localhost/hook", "loopback"),
        ("http://169.254.169.254/latest/meta-data/", "metadata"),
        ("http://10.0.0.1/hook", "private"),
        ("http://[fe80::1]/hook", "link-local"),
        ("http://0.0.0.0:8000/hook", "unspecified"),
        ("http://224.0.0.1/hook", "multicast"),
    ],
)
def test_refused_urls_at_submit(url: str, reason: str) -> None:
    with pytest.raises(WebhookTargetError) as caught:
        check_url(url, _settings())
    assert reason in str(caught.value)
    with pytest.raises(ApiError) as api_error:
        check_webhook_url(url, settings=_settings())
    assert api_error.value.status_code == 422 and api_error.value.code == "invalid_webhook_url"
    assert api_error.value.details[0]["loc"] == ["body", "webhook_url"]


def test_names_are_not_resolved_at_submit_and_allow_lists_apply(_loopback_only: Guard) -> None:
    check_url("https://hooks.example.com/x", _settings())  # the guard fails any lookup
    check_url("https://8.8.8.8/x", _settings())
    allowed = _settings(webhook_allowed_hosts=["localhost", "10.0.0.1"],
                        webhook_allowed_networks=["127.0.0.0/8"])
    check_url("http://localhost:8000/x", allowed)
    check_url("http://10.0.0.1/x", allowed)
    check_url("http://127.0.0.1:9/x", allowed)
    with pytest.raises(WebhookTargetError):  # allow-lists never admit credentials
        check_url("http://u:p@127.0.0.1:9/x", allowed)
    assert _loopback_only.connections == []


# --- the URL at delivery (resolved, every address checked) ------------------------------------


def _resolver(*addresses: str):  # type: ignore[no-untyped-def]
    calls: list[tuple[str, int]] = []

    def resolve(host: str, port: int) -> list[str]:
        calls.append((host, port))
        return list(addresses)

    resolve.calls = calls  # type: ignore[attr-defined]
    return resolve


@pytest.mark.parametrize(
    "addresses",
    [("10.0.0.1",), ("127.0.0.1",), ("169.254.169.254",), ("8.8.8.8", "10.0.0.1"), ("::1", "8.8.8.8")],
)
def test_a_name_resolving_to_any_refused_address_is_refused(addresses: tuple[str, ...]) -> None:
    resolver = _resolver(*addresses)
    with pytest.raises(WebhookTargetError) as caught:
        resolve_target("https://hooks.example.com/x", _settings(), resolver=resolver)
    assert "hooks.example.com resolves to" in str(caught.value)
    assert resolver.calls == [("hooks.example.com", 443)]


def test_a_public_name_is_pinned_to_the_checked_address() -> None:
    target = resolve_target("https://Hooks.Example.com:8443/a?b=1", _settings(),
                            resolver=_resolver("8.8.8.8", "8.8.4.4"))
    assert target.address == "8.8.8.8"
    assert target.addresses == ("8.8.8.8", "8.8.4.4")
    assert str(target.request_url()) == "https://8.8.8.8:8443/a?b=1"  # no second lookup
    assert target.headers == {"Host": "hooks.example.com:8443"}
    assert target.extensions == {"sni_hostname": "hooks.example.com"}  # TLS checks the name
    v6 = resolve_target("http://hooks.example.com/x", _settings(), resolver=_resolver("2606:4700::1"))
    assert str(v6.request_url()) == "http://[2606:4700::1]/x" and v6.extensions == {}


def test_allow_lists_admit_internal_targets_at_delivery() -> None:
    by_host = _settings(webhook_allowed_hosts=["hooks.internal"])
    target = resolve_target("http://hooks.internal/x", by_host, resolver=_resolver("10.1.2.3"))
    assert target.address == "10.1.2.3"
    with pytest.raises(WebhookTargetError):
        resolve_target("http://other.internal/x", by_host, resolver=_resolver("10.1.2.3"))
    by_network = _settings(webhook_allowed_networks=["10.1.0.0/16"])
    assert resolve_target("http://a.internal/x", by_network, resolver=_resolver("10.1.2.3")).address
    with pytest.raises(WebhookTargetError):
        resolve_target("http://a.internal/x", by_network, resolver=_resolver("10.1.2.3", "10.2.0.1"))


def test_a_name_without_addresses_is_a_resolve_error() -> None:
    with pytest.raises(WebhookResolveError):
        resolve_target("http://hooks.example.com/x", _settings(), resolver=_resolver())


# --- deliveries -------------------------------------------------------------------------------


@pytest.fixture
def sessions(tmp_path: Path) -> Any:
    url = f"sqlite:///{tmp_path / 'delivery.db'}"
    migrate(url)
    return get_session_factory(url)


def _delivery(sessions: Any, url: str) -> uuid.UUID:
    delivery_id = uuid.uuid4()
    with sessions() as session:
        session.add(WebhookDelivery(id=delivery_id, tenant="t1", event="job.finished", job_id=uuid.uuid4(),
                                    url=url, payload={"event": "job.finished", "job": {"n": 7}},
                                    status=DeliveryStatus.PENDING.value, attempts=0))
        session.commit()
    return delivery_id


def _row(sessions: Any, delivery_id: uuid.UUID) -> WebhookDelivery:
    with sessions() as session:
        row = session.get(WebhookDelivery, delivery_id)
        assert row is not None
        session.expunge(row)
        return row


@dataclass
class Receiver:
    """HTTP server on 127.0.0.1: ``/redirect...`` answers 302 to ``location``, others 200."""

    location: str = ""
    received: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def paths(self) -> list[str]:
        return [path for path, _, _ in self.received]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    state = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            state.received.append((self.path, dict(self.headers.items()), body))
            redirect = self.path.startswith("/redirect")
            self.send_response(302 if redirect else 200)
            if redirect:
                self.send_header("Location", state.location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            return

    state.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=state.server.serve_forever, daemon=True)
    thread.start()
    yield state
    state.server.shutdown()
    state.server.server_close()


DELIVERY_SETTINGS: dict[str, Any] = {"webhook_max_attempts": 3, "webhook_timeout_seconds": 2.0,
                                     "webhook_backoff_base_seconds": 0.01}


def _refuse_posts(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_post(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a refused target must not be sent anything")

    monkeypatch.setattr(delivery, "_post", no_post)


def test_delivery_to_a_name_resolving_to_a_private_address_is_refused_before_connecting(
    sessions: Any, monkeypatch: pytest.MonkeyPatch, _loopback_only: Guard
) -> None:
    monkeypatch.setattr(ssrf_guard, "_resolve", _resolver("10.0.0.1"))
    _refuse_posts(monkeypatch)
    delivery_id = _delivery(sessions, "https://hooks.example.com/x")
    step = deliver_once(sessions, delivery_id=delivery_id, settings=_settings(**DELIVERY_SETTINGS))
    assert step.status is DeliveryStatus.GIVEN_UP and step.retry_in_seconds is None  # never retried
    row = _row(sessions, delivery_id)
    assert row.status == DeliveryStatus.GIVEN_UP.value and row.attempts == 1
    assert row.last_error is not None and "refused target" in row.last_error and "10.0.0.1" in row.last_error
    assert _loopback_only.connections == []


@pytest.mark.parametrize(
    "url",
    ["http://169.254.169.254/latest/meta-data/", "http://[::1]:9/x", "http://user:pw@hooks.example.com/x",
     "http://localhost:9/x"],
)
def test_rows_stored_before_the_checks_are_refused_at_delivery(
    sessions: Any, monkeypatch: pytest.MonkeyPatch, _loopback_only: Guard, url: str
) -> None:
    _refuse_posts(monkeypatch)
    delivery_id = _delivery(sessions, url)
    step = deliver_once(sessions, delivery_id=delivery_id, settings=_settings(**DELIVERY_SETTINGS))
    assert step.status is DeliveryStatus.GIVEN_UP
    assert _loopback_only.connections == []


def test_a_resolver_failure_is_retried_not_given_up(sessions: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(host: str, port: int) -> list[str]:
        raise WebhookResolveError(f"{host} does not resolve")

    monkeypatch.setattr(ssrf_guard, "_resolve", fail)
    delivery_id = _delivery(sessions, "https://hooks.example.com/x")
    step = deliver_once(sessions, delivery_id=delivery_id, settings=_settings(**DELIVERY_SETTINGS))
    assert step.status is DeliveryStatus.PENDING and step.retry_in_seconds is not None


def test_loopback_receiver_needs_the_allow_list(sessions: Any, receiver: Receiver) -> None:
    refused = _delivery(sessions, receiver.url + "/no-list")
    step = deliver_once(sessions, delivery_id=refused, settings=_settings(**DELIVERY_SETTINGS))
    assert step.status is DeliveryStatus.GIVEN_UP
    assert receiver.received == []

    allowed = _settings(webhook_allowed_networks=["127.0.0.0/8"], **DELIVERY_SETTINGS)
    delivery_id = _delivery(sessions, receiver.url + "/listed")
    step = deliver_once(sessions, delivery_id=delivery_id, settings=allowed)
    assert step.status is DeliveryStatus.DELIVERED and step.status_code == 200
    [(path, headers, body)] = receiver.received
    assert path == "/listed" and json.loads(body)["job"] == {"n": 7}
    with sessions() as session:
        secret = tenant_secret(session, tenant="t1")
    assert verify_signature(secret, headers[SIGNATURE_HEADER], body)


def test_a_name_is_delivered_to_the_address_that_was_checked(
    sessions: Any, receiver: Receiver, monkeypatch: pytest.MonkeyPatch, _loopback_only: Guard
) -> None:
    monkeypatch.setattr(ssrf_guard, "_resolve", _resolver("127.0.0.1"))  # "hooks.test" -> loopback
    settings = _settings(webhook_allowed_hosts=["hooks.test"], **DELIVERY_SETTINGS)
    delivery_id = _delivery(sessions, f"http://hooks.test:{receiver.port}/pinned")
    step = deliver_once(sessions, delivery_id=delivery_id, settings=settings)
    assert step.status is DeliveryStatus.DELIVERED
    [(path, headers, _)] = receiver.received
    assert path == "/pinned" and headers["Host"] == f"hooks.test:{receiver.port}"
    assert [str(address[0]) for address in _loopback_only.connections] == ["127.0.0.1"]


@pytest.mark.parametrize("location", ["/landing", "http://169.254.169.254/latest/meta-data/"])
def test_redirects_are_never_followed(
    sessions: Any, receiver: Receiver, _loopback_only: Guard, location: str
) -> None:
    receiver.location = location if location.startswith("http") else receiver.url + location
    settings = _settings(webhook_allowed_networks=["127.0.0.0/8"], **DELIVERY_SETTINGS)
    delivery_id = _delivery(sessions, receiver.url + "/redirect")
    step = deliver_once(sessions, delivery_id=delivery_id, settings=settings)
    assert step.status is DeliveryStatus.PENDING and step.status_code == 302
    assert step.error is not None and "redirects are not followed" in step.error
    assert receiver.paths() == ["/redirect"]  # the Location was never requested
    assert len(_loopback_only.connections) == 1


def test_the_next_checked_address_is_tried_only_when_connecting_fails(
    sessions: Any, receiver: Receiver, monkeypatch: pytest.MonkeyPatch, _loopback_only: Guard
) -> None:
    # The receiver listens on 127.0.0.1 only: connecting to ::1 fails, then 127.0.0.1 answers.
    monkeypatch.setattr(ssrf_guard, "_resolve", _resolver("::1", "127.0.0.1"))
    settings = _settings(webhook_allowed_hosts=["hooks.test"], **DELIVERY_SETTINGS)
    delivery_id = _delivery(sessions, f"http://hooks.test:{receiver.port}/second")
    step = deliver_once(sessions, delivery_id=delivery_id, settings=settings)
    assert step.status is DeliveryStatus.DELIVERED
    assert receiver.paths() == ["/second"]
    assert [str(address[0]) for address in _loopback_only.connections] == ["::1", "127.0.0.1"]
