"""The webhook SSRF guard: which URLs and addresses a webhook may be sent to.

A webhook URL is a request the service makes on a client's behalf, so it may only reach the
public internet. :func:`check_url` (at submit, no DNS) refuses other schemes, credentials in the
URL, ``localhost`` names and literal non-public addresses; :func:`resolve_target` (at every
delivery) resolves the host, refuses the delivery when ANY of its addresses is loopback,
private, link-local (cloud metadata), multicast, unspecified, reserved or otherwise not globally
routable, and the POST then connects to exactly the address that was checked (``WebhookTarget``:
no second lookup an attacker's DNS could answer differently). ``settings.webhooks.allowed_hosts``
/ ``webhook_allowed_networks`` name the exceptions (an internal receiver, tests on 127.0.0.1).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import httpx

from scheduler.infra.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Sequence[str]]

# Instance metadata services (AWS/GCP/Azure/OpenStack, AWS IPv6, ECS task metadata, Alibaba):
# all in refused ranges anyway; named so the refusal says what it protected.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(address) for address in (
    "169.254.169.254", "fd00:ec2::254", "169.254.170.2", "100.100.100.200",
))
LOCALHOST_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


class WebhookTargetError(ValueError):
    """A webhook URL the service never sends to (refused at submit and at delivery)."""


class WebhookResolveError(OSError):
    """The webhook host does not resolve right now (a failed attempt, retried)."""


def _address(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _normal_host(host: str) -> str:
    return host.lower().rstrip(".").strip("[]")


@lru_cache(maxsize=16)
def _networks(cidrs: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(cidr, strict=False) for cidr in cidrs)


def refused_reason(address: str | IPAddress, settings: Settings) -> str | None:
    """Why webhook traffic may not go to ``address``; None when it may (public, or allow-listed).

    An IPv4 address embedded in IPv6 (``::ffff:127.0.0.1``, 6to4) is judged as that IPv4
    address. ``settings.webhooks.allowed_networks`` overrides every refusal.
    """
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        ip = ipaddress.IPv6Address(str(ip).split("%", 1)[0])
    embedded = (ip.ipv4_mapped or ip.sixtofour) if isinstance(ip, ipaddress.IPv6Address) else None
    judged = embedded or ip
    allowed = _networks(tuple(settings.webhooks.allowed_networks))
    if any(ip in network or judged in network for network in allowed):
        return None
    if judged in METADATA_ADDRESSES or ip in METADATA_ADDRESSES:
        return "a cloud metadata address"
    for flag, reason in (
        ("is_unspecified", "an unspecified"), ("is_loopback", "a loopback"),
        ("is_link_local", "a link-local"), ("is_multicast", "a multicast"), ("is_private", "a private"),
        ("is_reserved", "a reserved"),
    ):
        if getattr(judged, flag) or getattr(ip, flag):
            return f"{reason} address"
    if not judged.is_global or not ip.is_global:
        return "not a public address"
    return None


def check_url(url: str, settings: Settings) -> httpx.URL:
    """What can be known about a webhook URL without DNS (at submit, and again at delivery).

    Raises :class:`WebhookTargetError` for a scheme other than http/https, a missing host,
    credentials in the URL (they would be sent to the target as Basic auth, and logged), and a
    host that is a ``localhost`` name or a literal address :func:`refused_reason` refuses —
    unless ``settings.webhooks.allowed_hosts`` names the host.
    """
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise WebhookTargetError(f"not a valid URL: {exc}") from None
    if parsed.scheme not in ("http", "https"):
        raise WebhookTargetError("the URL must be http or https")
    if not parsed.host:
        raise WebhookTargetError("the URL has no host")
    if parsed.userinfo:
        raise WebhookTargetError("the URL must not carry credentials (user:password@)")
    host = _normal_host(parsed.host)
    if host in settings.webhooks.allowed_hosts:
        return parsed
    literal = _address(host)
    if literal is not None:
        reason = refused_reason(literal, settings)
        if reason is not None:
            raise WebhookTargetError(f"{host} is {reason}")
    elif host in LOCALHOST_NAMES or host.endswith(".localhost"):
        raise WebhookTargetError(f"{host} is a loopback name")
    return parsed


def _resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the system resolver)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise WebhookResolveError(f"{host} does not resolve: {exc}") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True)
class WebhookTarget:
    """A checked webhook URL and the addresses (all checked) its POST may connect to, in order."""

    url: httpx.URL
    addresses: tuple[str, ...]

    @property
    def address(self) -> str:
        """The address tried first."""
        return self.addresses[0]

    def request_url(self, address: str | None = None) -> httpx.URL:
        """The URL with its host replaced by a checked address (no second DNS lookup)."""
        return self.url.copy_with(host=(address or self.address).split("%", 1)[0])

    @property
    def headers(self) -> dict[str, str]:
        return {"Host": self.url.netloc.decode("ascii")}

    @property
    def extensions(self) -> dict[str, Any]:
        """TLS: SNI and certificate check against the URL's host name, not the address."""
        if self.url.scheme == "https" and _address(_normal_host(self.url.host)) is None:
            return {"sni_hostname": self.url.raw_host.decode("ascii")}
        return {}


def resolve_target(url: str, settings: Settings, *, resolver: Resolver | None = None) -> WebhookTarget:
    """Check ``url`` and its host's addresses now (at delivery); see the module docstring.

    Raises :class:`WebhookTargetError` (never delivered: any address refused) or
    :class:`WebhookResolveError` (no address now: retried). ``resolver(host, port)`` defaults to
    the system resolver.
    """
    parsed = check_url(url, settings)
    host = _normal_host(parsed.host)
    literal = _address(host)
    if literal is not None:
        addresses: Sequence[str] = [str(literal)]
    else:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        addresses = list((resolver or _resolve)(host, port))
        if not addresses:
            raise WebhookResolveError(f"{host} resolves to no address")
    if host not in settings.webhooks.allowed_hosts:
        for address in addresses:
            reason = refused_reason(address, settings)
            if reason is not None:
                shown = host if literal is not None else f"{host} resolves to {address}, which"
                raise WebhookTargetError(f"{shown} is {reason}")
    return WebhookTarget(url=parsed, addresses=tuple(str(address) for address in addresses))
