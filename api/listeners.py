"""Which listeners ``cloverq api`` opens for the three planes, with which TLS, and how one process
serves them all.

One-port mode (no ``admin_port``/``ops_port``): one listener serves every plane; uvicorn runs as
always (``--workers`` processes allowed). Split mode: one listener per plane that has a port (a
plane without one rides on the admin listener, else on the public one), each its own uvicorn
``Server`` with its own TLS, all in one process around **one** app (one database pool, one Redis
client, one lifespan: the public listener's). Scaling a split-mode API is by replicas (each a
process behind the load balancer), not by ``--workers``: uvicorn's process supervisor runs one
``Server`` per process, and planes with different TLS need one each.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import ssl
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from api.graceful_stop import GracefulStop
from api.planes import ALL_PLANES, Plane, listener_app
from scheduler.infra.settings_groups.planes import PlaneSettings

STARTUP_POLL_SECONDS = 0.05
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A listener's certificate and key, and for mutual TLS the CA its clients' certificates need."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None

    def uvicorn_options(self) -> dict[str, Any]:
        """uvicorn's ``ssl_*`` options for these files."""
        options: dict[str, Any] = {"ssl_certfile": str(self.cert_file), "ssl_keyfile": str(self.key_file)}
        if self.client_ca_file is not None:
            options.update(ssl_ca_certs=str(self.client_ca_file), ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options


@dataclass(frozen=True, slots=True)
class ListenerSpec:
    """One listening socket of the API and the planes it serves."""

    name: str  # the plane it is named after: public, admin or ops
    planes: frozenset[Plane]
    host: str
    port: int
    tls: TlsFiles | None

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def url(self) -> str:
        """The base URL a client on this host uses (a wildcard bind is reached on loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        shown = f"[{host}]" if ":" in host else host
        return f"{self.scheme}://{shown}:{self.port}"


def plan_listeners(planes: PlaneSettings, *, host: str, port: int) -> list[ListenerSpec]:
    """The listeners for these settings, the public one first (see the module docstring)."""
    public_tls = _tls(planes.tls_cert_file, planes.tls_key_file)
    if not planes.split:
        return [ListenerSpec("public", ALL_PLANES, host, port, public_tls)]
    served: dict[str, set[Plane]] = {"public": {Plane.PUBLIC}}
    if planes.admin_port is not None:
        served["admin"] = {Plane.ADMIN}
    else:
        served["public"].add(Plane.ADMIN)
    if planes.ops_port is not None:
        served["ops"] = {Plane.OPS}
    else:
        served["admin" if "admin" in served else "public"].add(Plane.OPS)
    specs = [ListenerSpec("public", frozenset(served["public"]), host, port, public_tls)]
    if planes.admin_port is not None:
        client_ca = planes.admin_tls_client_ca_file
        admin_tls = _tls(planes.admin_tls_cert_file, planes.admin_tls_key_file, client_ca) \
            or _tls(planes.tls_cert_file, planes.tls_key_file, client_ca)
        specs.append(ListenerSpec("admin", frozenset(served["admin"]), planes.admin_host, planes.admin_port,
                                  admin_tls))
    if planes.ops_port is not None:
        ops_tls = _tls(planes.ops_tls_cert_file, planes.ops_tls_key_file) or public_tls
        specs.append(ListenerSpec("ops", frozenset(served["ops"]), planes.ops_host, planes.ops_port, ops_tls))
    return specs


def _tls(cert: Path | None, key: Path | None, client_ca: Path | None = None) -> TlsFiles | None:
    return TlsFiles(cert, key, client_ca) if cert is not None and key is not None else None


class PlaneServer(uvicorn.Server):
    """A ``Server`` that leaves signals to :func:`serve_listeners` (several share one process)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def serve_listeners(app: ASGIApp, specs: Sequence[ListenerSpec], options: dict[str, Any],
                    sockets: Sequence[socket.socket | None]) -> bool:
    """Serve ``app`` on every listener in this process until SIGINT/SIGTERM; False if it never
    started. ``options``: uvicorn ``Config`` options shared by all (protocol, timeouts, logging);
    ``sockets``: a bound socket per spec (``cloverq up`` binds them itself) or None to bind here."""
    servers = []
    for index, spec in enumerate(specs):
        config = uvicorn.Config(listener_app(app, spec.planes), **{
            **options, "host": spec.host, "port": spec.port, "lifespan": "on" if index == 0 else "off",
            **(spec.tls.uvicorn_options() if spec.tls is not None else {})})
        servers.append(PlaneServer(config))

    def stop_now(signum: int) -> None:
        for server in servers:
            if server.should_exit and signum == signal.SIGINT:
                server.force_exit = True
            server.should_exit = True

    stop = GracefulStop(stop_now)  # SIGTERM drains first (api/drain.py)
    previous = {signum: signal.signal(signum, stop) for signum in HANDLED_SIGNALS}
    try:
        return asyncio.run(_serve_all(servers, sockets))
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


async def _serve_all(servers: Sequence[Any], sockets: Sequence[socket.socket | None]) -> bool:
    """The first server (with the app's lifespan) started first, then the others; when one stops,
    all stop."""
    def serve(index: int) -> asyncio.Task[None]:
        bound = sockets[index]
        return asyncio.create_task(servers[index].serve(sockets=[bound] if bound is not None else None))

    tasks = [serve(0)]
    while not servers[0].started:
        if tasks[0].done():
            await tasks[0]  # a start-up failure (uvicorn exits; the lifespan's error is logged)
            return False
        await asyncio.sleep(STARTUP_POLL_SECONDS)
    tasks += [serve(index) for index in range(1, len(servers))]
    while not any(server.should_exit for server in servers) and not any(task.done() for task in tasks):
        await asyncio.sleep(STARTUP_POLL_SECONDS)
    for server in servers:
        server.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
    return all(server.started for server in servers)
