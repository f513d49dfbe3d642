"""Network allow-lists and the client address behind trusted proxies: pure functions.

Two rules the deployment guides ask for live here, used by the API's plane guard
(``api/planes.py``: a CIDR list per plane) and by key authentication (``api/auth.py``: a CIDR
list per API key, ``allowed_networks``):

* **An empty list allows every address**; a non-empty list allows exactly the addresses inside
  one of its networks. IPv4-mapped IPv6 addresses (``::ffff:10.0.0.1``, what a dual-stack socket
  reports for an IPv4 peer) are compared as the IPv4 address they carry.
* **The client address is the socket's peer**, unless that peer is a configured trusted proxy:
  then the forwarding headers are read right to left (``Forwarded: for=`` when present, else
  ``X-Forwarded-For``) and the first hop that is not itself a trusted proxy is the client. The
  right-most untrusted hop is the only one a proxy of ours vouches for: everything left of it
  was written by the caller. A header from an untrusted peer is ignored entirely, so a caller
  cannot choose its own address by sending one.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# One ``for=`` parameter of RFC 7239's Forwarded header: a token or a quoted string.
_FORWARDED_FOR = re.compile(r'for\s*=\s*("(?:[^"\\]|\\.)*"|[^;,\s]*)', re.IGNORECASE)


def parse_networks(items: Iterable[str]) -> tuple[IPNetwork, ...]:
    """CIDR texts (``10.0.0.0/8``, ``127.0.0.2``, ``::1/128``) -> networks; ValueError on a bad one.

    Host bits are allowed (``10.1.2.3/8`` means ``10.0.0.0/8``): operators copy addresses."""
    return tuple(ipaddress.ip_network(item.strip(), strict=False) for item in items if item.strip())


def normalised_networks(items: Iterable[str]) -> list[str]:
    """CIDR texts in canonical form (what settings and key rows store); ValueError on a bad one."""
    return [str(network) for network in parse_networks(items)]


def parse_address(text: str | None) -> IPAddress | None:
    """An address from a socket peer or a header hop (brackets and a port allowed); None if it is none.

    ``unknown``, obfuscated identifiers (``_hidden``) and Unix sockets give None."""
    if not text:
        return None
    text = text.strip().strip('"')
    if text.startswith("["):  # [2001:db8::1]:4711
        text = text[1:].split("]", 1)[0]
    elif text.count(":") == 1:  # 192.0.2.43:47011
        text = text.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def allowed(address: IPAddress | None, networks: Sequence[IPNetwork]) -> bool:
    """Whether ``address`` may pass a list: every address when the list is empty; an unknown
    address (no socket peer, e.g. a Unix socket) only then."""
    if not networks:
        return True
    if address is None:
        return False
    return any(address.version == network.version and address in network for network in networks)


def forwarded_hops(forwarded: str | None, x_forwarded_for: str | None) -> list[str]:
    """The hops a request came through, client first: ``Forwarded``'s ``for=`` values when that
    header is present, else ``X-Forwarded-For``'s comma-separated list."""
    if forwarded:
        return [match.group(1).strip('"') for match in _FORWARDED_FOR.finditer(forwarded)]
    if x_forwarded_for:
        return [hop.strip() for hop in x_forwarded_for.split(",") if hop.strip()]
    return []


def client_address(peer: str | None, hops: Sequence[str],
                   trusted_proxies: Sequence[IPNetwork]) -> IPAddress | None:
    """The caller's address: the socket ``peer``, or behind trusted proxies the right-most hop
    that is not one of them (see the module docstring). A hop that is not an address (``unknown``)
    stops the walk at the last trusted one: nothing left of it can be vouched for."""
    address = parse_address(peer)
    if not trusted_proxies or not allowed(address, trusted_proxies) or address is None:
        return address
    for hop in reversed(hops):
        hop_address = parse_address(hop)
        if hop_address is None:
            return address
        address = hop_address
        if not allowed(address, trusted_proxies):
            return address
    return address
