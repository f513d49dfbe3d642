"""The planes' pure rules: which plane a path is, which listeners the settings open, allow-lists and
the client address behind trusted proxies (scheduler/access/networks.py, api/planes.py,
api/listeners.py)."""

from __future__ import annotations

import ipaddress
import ssl
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from api.listeners import plan_listeners
from api.planes import ALL_PLANES, Plane, plane_of_path
from scheduler.access.networks import (
    allowed,
    client_address,
    forwarded_hops,
    normalised_networks,
    parse_address,
    parse_networks,
)
from scheduler.infra.settings import Settings
from scheduler.infra.settings_groups.planes import PlaneSettings


@pytest.mark.parametrize(("path", "plane"), [
    ("/v1/jobs", Plane.PUBLIC), ("/v1/jobs/abc/events", Plane.PUBLIC), ("/v1/chat/completions", Plane.PUBLIC),
    ("/openai/v1/models", Plane.PUBLIC), ("/docs", Plane.PUBLIC), ("/", Plane.PUBLIC),
    ("/v1/administer", Plane.PUBLIC), ("/dashboards", Plane.PUBLIC),  # a prefix of text is not a root
    ("/v1/admin", Plane.ADMIN), ("/v1/admin/keys", Plane.ADMIN), ("/v1/admin/overview/", Plane.ADMIN),
    ("/dashboard", Plane.ADMIN), ("/dashboard/app.js", Plane.ADMIN), ("/dashboard/login", Plane.ADMIN),
    ("/metrics", Plane.OPS), ("/livez", Plane.OPS), ("/healthz", Plane.OPS), ("/readyz/", Plane.OPS),
    ("/metrics/extra", Plane.PUBLIC),
])
def test_plane_of_path(path: str, plane: Plane) -> None:
    assert plane_of_path(path) == plane


def test_every_route_of_the_app_has_the_plane_its_prefix_says(test_settings: Settings) -> None:
    """No admin route outside /v1/admin or /dashboard, no ops route elsewhere: a new route cannot
    land on the public plane by accident."""
    from api.app import create_app

    paths = set(_route_paths(create_app(test_settings).routes))
    admin = {path for path in paths if plane_of_path(path) is Plane.ADMIN}
    ops = {path for path in paths if plane_of_path(path) is Plane.OPS}
    assert ops == {"/metrics", "/livez", "/healthz", "/readyz", "/readyz/replica"}
    assert "/v1/admin/keys" in admin and "/dashboard" in admin
    assert not any("admin" in path for path in paths - admin), "an admin-looking route on the public plane"


def _route_paths(routes: Iterable[Any], prefix: str = "") -> Iterator[str]:
    """Every route's full path (FastAPI 0.16x keeps an included router as one entry holding its
    own routes and prefix)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _route_paths(included.routes, prefix + route.include_context.prefix)
        elif hasattr(route, "path"):
            yield prefix + route.path


def test_one_port_mode_serves_every_plane_on_one_listener() -> None:
    [only] = plan_listeners(PlaneSettings(), host="0.0.0.0", port=8000)
    assert only.planes == ALL_PLANES and only.url() == "http://127.0.0.1:8000" and only.tls is None


def test_split_listeners_and_where_a_plane_without_a_port_goes(tmp_path: Path) -> None:
    cert, key, ca = tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "ca.pem"
    both = plan_listeners(PlaneSettings(admin_port=9001, ops_port=9002, tls_cert_file=cert, tls_key_file=key,
                                        admin_tls_client_ca_file=ca), host="0.0.0.0", port=9000)
    assert [(s.name, s.planes, s.host, s.port) for s in both] == [
        ("public", {Plane.PUBLIC}, "0.0.0.0", 9000), ("admin", {Plane.ADMIN}, "127.0.0.1", 9001),
        ("ops", {Plane.OPS}, "127.0.0.1", 9002)]
    public, admin, ops = both
    assert public.url() == "https://127.0.0.1:9000"
    assert admin.tls is not None and admin.tls.uvicorn_options() == {
        "ssl_certfile": str(cert), "ssl_keyfile": str(key), "ssl_ca_certs": str(ca),
        "ssl_cert_reqs": ssl.CERT_REQUIRED}
    assert ops.tls is not None and "ssl_ca_certs" not in ops.tls.uvicorn_options()  # mTLS: admin only
    admin_only = plan_listeners(PlaneSettings(admin_port=9001), host="127.0.0.1", port=9000)
    assert [(s.name, s.planes) for s in admin_only] == [("public", {Plane.PUBLIC}),
                                                        ("admin", {Plane.ADMIN, Plane.OPS})]
    ops_only = plan_listeners(PlaneSettings(ops_port=9002), host="127.0.0.1", port=9000)
    assert [(s.name, s.planes) for s in ops_only] == [("public", {Plane.PUBLIC, Plane.ADMIN}),
                                                      ("ops", {Plane.OPS})]


def test_plane_settings_refuse_half_a_tls_pair_and_bad_networks(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="tls_cert_file and tls_key_file go together"):
        PlaneSettings(tls_cert_file=tmp_path / "c.pem")
    with pytest.raises(ValidationError, match="needs the admin listener to serve TLS"):
        PlaneSettings(admin_tls_client_ca_file=tmp_path / "ca.pem")
    with pytest.raises(ValidationError):
        Settings(admin_allowed_networks="10.0.0.0/33")
    settings = Settings(admin_allowed_networks="10.1.2.3/8, 127.0.0.2", trusted_proxies='["::1"]')
    assert settings.planes.admin_allowed_networks == ["10.0.0.0/8", "127.0.0.2/32"]
    assert settings.planes.trusted_proxies == ["::1/128"]


def test_allow_lists() -> None:
    networks = parse_networks(["127.0.0.2/32", "10.0.0.0/8", "2001:db8::/32"])
    assert allowed(parse_address("127.0.0.2"), networks)
    assert allowed(parse_address("10.200.1.1"), networks)
    assert allowed(parse_address("::ffff:10.0.0.1"), networks)  # a dual-stack socket's IPv4 peer
    assert allowed(parse_address("2001:db8::7"), networks)
    assert not allowed(parse_address("127.0.0.3"), networks)
    assert not allowed(None, networks)  # no address (a Unix socket) passes only an empty list
    assert allowed(None, ()) and allowed(parse_address("192.0.2.1"), ())
    assert normalised_networks([" 127.0.0.9 ", ""]) == ["127.0.0.9/32"]
    with pytest.raises(ValueError):
        normalised_networks(["not-a-network"])


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1", "127.0.0.1"), ("192.0.2.43:47011", "192.0.2.43"), ("[2001:db8::1]:4711", "2001:db8::1"),
    ('"[2001:db8::1]"', "2001:db8::1"), ("2001:db8::1", "2001:db8::1"), ("unknown", None), ("_hidden", None),
    ("", None), (None, None),
])
def test_parse_address(text: str | None, expected: str | None) -> None:
    address = parse_address(text)
    assert (str(address) if address is not None else None) == expected


def test_forwarded_hops_prefers_the_standard_header() -> None:
    assert forwarded_hops('for=192.0.2.60;proto=http, for="[2001:db8::1]:80"', "10.9.9.9") == [
        "192.0.2.60", "[2001:db8::1]:80"]
    assert forwarded_hops(None, "203.0.113.7, 10.0.0.2") == ["203.0.113.7", "10.0.0.2"]
    assert forwarded_hops(None, None) == []


def _client(peer: str, hops: list[str], trusted: list[str]) -> str | None:
    address = client_address(peer, hops, parse_networks(trusted))
    return str(address) if address is not None else None


def test_client_address_behind_trusted_proxies() -> None:
    proxies = ["10.0.0.0/24"]
    # An untrusted peer's header changes nothing: it cannot choose its address.
    assert _client("203.0.113.9", ["127.0.0.1"], proxies) == "203.0.113.9"
    # Through one trusted proxy: the hop it appended.
    assert _client("10.0.0.5", ["198.51.100.7"], proxies) == "198.51.100.7"
    # A spoofed left-most entry: the right-most untrusted hop wins, not the caller's claim.
    assert _client("10.0.0.5", ["127.0.0.1", "198.51.100.7"], proxies) == "198.51.100.7"
    # Two trusted proxies in a row are skipped.
    assert _client("10.0.0.5", ["198.51.100.7", "10.0.0.6"], proxies) == "198.51.100.7"
    # A hop that is no address stops the walk at the last trusted one.
    assert _client("10.0.0.5", ["198.51.100.7", "unknown"], proxies) == "10.0.0.5"
    # A trusted proxy without a header is itself the client; no proxies configured: the peer.
    assert _client("10.0.0.5", [], proxies) == "10.0.0.5"
    assert _client("10.0.0.5", ["198.51.100.7"], []) == "10.0.0.5"
    assert client_address(None, ["198.51.100.7"], parse_networks(proxies)) is None
    assert isinstance(client_address("::ffff:10.0.0.5", ["198.51.100.7"], parse_networks(proxies)),
                      ipaddress.IPv4Address)
