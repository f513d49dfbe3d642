"""The API's three planes, and the guard that keeps each request on its own.

The deployment guides separate the data plane from the management plane and open the management
port only to the internal network. cloverq's API has three planes, told apart by path:

* **public**: everything a client calls (jobs, batches, decisions, the OpenAI routes, events, docs);
* **admin**: ``/v1/admin/...`` and the operator dashboard (``/dashboard...``);
* **ops**: ``/metrics``, ``/livez``, ``/healthz``, ``/readyz``, ``/readyz/replica`` (scrapers and
  probes).

``cloverq api`` serves them on one listener (one-port mode, development) or on a listener each
(``admin_port``/``ops_port``, ``api/listeners.py``); a listener marks the requests it accepts with
the planes it serves (:func:`listener_app`). :class:`PlaneGuard`, the app's guard middleware, then

1. answers **404**, exactly as for a path that does not exist, when the request's plane is not
   one its listener serves (split mode: the public port has no admin or metrics path at all);
2. works out the **client address** (the socket peer, or behind a trusted proxy the forwarded
   one: ``scheduler/access/networks.py``) and keeps it for the rest of the request
   (``api/client_address.py``: API keys' own ``allowed_networks`` read it);
3. answers **403 ``network_not_allowed``** when that address is outside the plane's allow-list,
   counted in ``cloverq_network_refusals_total{plane,reason="plane"}`` and written to the audit log
   with the address.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

import structlog
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from api.client_address import remember_client_address
from api.errors import error_response
from scheduler.access.networks import allowed, client_address, forwarded_hops, parse_networks
from scheduler.infra.settings_groups.planes import PlaneSettings
from scheduler.observability.audit import audit
from scheduler.observability.process_metrics import record_network_refusal

log = structlog.get_logger(__name__)

LISTENER_PLANES_KEY = "cloverq.listener_planes"  # ASGI scope key: the planes of the accepting listener
NETWORK_NOT_ALLOWED = "network_not_allowed"


class Plane(StrEnum):
    """Which part of the API a path belongs to."""

    PUBLIC = "public"
    ADMIN = "admin"
    OPS = "ops"


ALL_PLANES: frozenset[Plane] = frozenset(Plane)
OPS_PATHS = frozenset({"/metrics", "/livez", "/healthz", "/readyz", "/readyz/replica"})
ADMIN_ROOTS = ("/v1/admin", "/dashboard")


def plane_of_path(path: str) -> Plane:
    """The plane a request path belongs to (a trailing slash changes nothing)."""
    trimmed = path.rstrip("/") or "/"
    if trimmed in OPS_PATHS:
        return Plane.OPS
    if any(trimmed == root or trimmed.startswith(root + "/") for root in ADMIN_ROOTS):
        return Plane.ADMIN
    return Plane.PUBLIC


def listener_app(app: ASGIApp, planes: Iterable[Plane]) -> ASGIApp:
    """``app`` as one listener serves it: its requests carry the planes it serves."""
    served = frozenset(planes)

    async def listener(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope = {**scope, LISTENER_PLANES_KEY: served}
        await app(scope, receive, send)

    return listener


class PlaneGuard:
    """Pure ASGI middleware: the plane's listener, the client address, the plane's allow-list
    (see the module docstring). Requests from an app served without :func:`listener_app` (a test
    client) may use every plane; the allow-lists still apply."""

    def __init__(self, app: ASGIApp, *, planes: PlaneSettings) -> None:
        self.app = app
        self.trusted_proxies = parse_networks(planes.trusted_proxies)
        self.networks = {
            Plane.PUBLIC: parse_networks(planes.public_allowed_networks),
            Plane.ADMIN: parse_networks(planes.admin_allowed_networks),
            Plane.OPS: parse_networks(planes.ops_allowed_networks),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan (the API serves no websockets)
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "/")
        plane = plane_of_path(path)
        if plane not in scope.get(LISTENER_PLANES_KEY, ALL_PLANES):
            await error_response(404, "not_found", "Not Found", path=path)(scope, receive, send)
            return
        peer = scope.get("client")
        hops = forwarded_hops(_header(scope, "forwarded"), _header(scope, "x-forwarded-for")) \
            if self.trusted_proxies else []
        address = client_address(peer[0] if peer else None, hops, self.trusted_proxies)
        remember_client_address(scope, address)
        if not allowed(address, self.networks[plane]):
            shown = str(address) if address is not None else "an unknown address"
            record_network_refusal(plane=plane.value, reason="plane")
            log.warning("network.refused", plane=plane.value, client_address=shown, path=path)
            audit("network.refused", actor_tenant=None, actor_key_id=None, via="api", target=plane.value,
                  client_address=shown, reason="plane", path=path)
            response = error_response(
                403, NETWORK_NOT_ALLOWED, f"The {plane.value} plane does not accept requests from {shown}.",
                {"plane": plane.value, "client_address": shown}, path=path)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _header(scope: Scope, name: str) -> str | None:
    """All values of one request header, joined as HTTP joins a repeated list header."""
    values = Headers(scope=scope).getlist(name)
    return ", ".join(values) if values else None
