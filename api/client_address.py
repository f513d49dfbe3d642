"""The caller's network address, as every part of the API sees it.

The plane guard (``api/planes.py``, outermost middleware) works it out once per request from the
socket peer and, behind a trusted proxy, the forwarding headers (``scheduler/access/networks.py``
has the rule) and keeps it in the ASGI scope's state; key authentication (a key's
``allowed_networks``), audit lines and the keys' last-used address read it here.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from starlette.requests import HTTPConnection

from scheduler.access.networks import IPAddress, parse_address

STATE_KEY = "client_address"


def remember_client_address(scope: MutableMapping[str, Any], address: IPAddress | None) -> None:
    """Record the request's resolved client address (the plane guard calls this)."""
    scope.setdefault("state", {})[STATE_KEY] = address


def request_client_address(connection: HTTPConnection) -> IPAddress | None:
    """The caller's address: the one the plane guard resolved, else the socket peer (an app
    served without the guard, as some unit tests build it)."""
    state = connection.scope.get("state") or {}
    if STATE_KEY in state:
        address: IPAddress | None = state[STATE_KEY]
        return address
    return parse_address(connection.client.host if connection.client else None)
