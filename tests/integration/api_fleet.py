"""A fleet of API replicas behind HAProxy, as real processes on loopback, for the fleet tests.

Three ``cloverq api`` processes (each one uvicorn process, exactly what a replica runs) that
share nothing but the session's SQL database and Redis, a real worker and beat, and HAProxy
(Debian's ``haproxy``) running ``deploy/haproxy/haproxy.cfg`` itself (``bench/fleet_services.py``'s
:class:`Haproxy`, as ``bench.fleet`` runs it): the file's environment variables point at the
replicas' loopback ports, so the shipped configuration (health check on ``/readyz/replica``,
retries, its 503) is what the tests exercise.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.fleet_services import HAPROXY_SERVERS, Haproxy
from scheduler.infra.settings import Settings
from tests.conftest import ProcessLauncher, ServiceProcess, free_port, wait_for

HAPROXY = shutil.which("haproxy")
NO_HAPROXY = "haproxy not installed (apt-get install -y haproxy; .ci/run does)"
SERVERS = HAPROXY_SERVERS  # the server lines of deploy/haproxy/haproxy.cfg
CHECK_INTER = "200ms"  # fall 2: a draining replica is out within about 0.6 s
REPLICA_START_TIMEOUT = 90.0


@dataclass
class Replica:
    """One API replica on a fixed loopback port (a restart binds the same port again)."""

    name: str
    port: int = field(default_factory=free_port)
    service: ServiceProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Fleet:
    """The replicas, HAProxy in front of them, and helpers to read and restart them."""

    settings: Settings
    launcher: ProcessLauncher
    replicas: list[Replica]
    haproxy: Haproxy | None = None

    @property
    def lb_url(self) -> str:
        assert self.haproxy is not None, "start_haproxy first"
        return self.haproxy.url

    def start_replica(self, replica: Replica) -> None:
        argv = [sys.executable, "-m", "cli", "api", "--host", "127.0.0.1", "--port", str(replica.port)]
        replica.service = self.launcher._spawn(argv, self.settings, f"api-{replica.name}")

    def wait_replica(self, replica: Replica) -> None:
        """Until the replica answers ``/readyz/replica`` with 200."""
        service = replica.service
        assert service is not None

        def up() -> bool:
            if service.proc.poll() is not None:
                code = service.proc.returncode
                raise AssertionError(f"{replica.name} exited {code}:\n{service.log()[-3000:]}")
            try:
                return httpx.get(replica.url + "/readyz/replica", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout=REPLICA_START_TIMEOUT, interval=0.1, message=f"replica {replica.name}")

    def start_haproxy(self, log_dir: Path) -> None:
        self.haproxy = Haproxy([replica.port for replica in self.replicas], log_dir / "haproxy.log",
                               check_inter=CHECK_INTER)
        self.haproxy.start()

    def stop_haproxy(self) -> None:
        if self.haproxy is not None:
            self.haproxy.stop()

    def server_states(self) -> dict[str, str]:
        """HAProxy's view of each replica: ``UP``, ``DOWN``, ``UP 1/2`` (going down), ... ."""
        assert self.haproxy is not None
        return self.haproxy.states()

    def served_counts(self) -> dict[str, int]:
        """Requests HAProxy sent to each replica so far (its ``stot`` counter; checks not counted)."""
        assert self.haproxy is not None
        return self.haproxy.served_counts()

    def wait_states(self, wanted: dict[str, str], *, timeout: float) -> None:
        def reached() -> bool:
            states = self.server_states()
            return all(states.get(name) == state for name, state in wanted.items())

        wait_for(reached, timeout=timeout, interval=0.05, message=f"HAProxy states {wanted}")


# --- a client of the job event stream that resumes -------------------------------------------------


@dataclass
class FollowedStream:
    """What one follower of ``/v1/jobs/{id}/events`` received over all its connections."""

    events: list[tuple[str | None, str, Any]] = field(default_factory=list)  # (id, event, data)
    connections: int = 0
    stopping_notes: int = 0  # connections a stopping replica ended ("reconnect" comment)

    @property
    def last_id(self) -> str | None:
        """The id of the last event received that had one (what ``Last-Event-ID`` sends)."""
        return next((event_id for event_id, _, _ in reversed(self.events) if event_id), None)

    @property
    def result(self) -> Any:
        return next((data for _, name, data in self.events if name == "result"), None)

    def text(self) -> str:
        """The job's text rebuilt from the ``delta`` events (``text[:offset] + text``)."""
        built = ""
        for _, name, data in self.events:
            if name == "delta":
                built = built[: max(0, int(data["offset"]))] + data["text"]
        return built


def sse_events(response: httpx.Response) -> Iterator[tuple[str | None, str, Any]]:
    """``(id, event, data)`` of each event of a streamed response; comments as ``(None, ':', text)``."""
    event_id: str | None = None
    name = "message"
    data: list[str] = []
    for line in response.iter_lines():
        if line.startswith(":"):
            yield None, ":", line[1:].strip()
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif not line and data:
            yield event_id, name, json.loads("\n".join(data))
            event_id, name, data = None, "message", []


def follow(urls: list[str], job_id: str, *, last_event_id: str | None = None,
           stop_after_blocks: int | None = None, timeout: float = 60.0,
           into: FollowedStream | None = None) -> FollowedStream:
    """Follow the job's events until ``result``, reconnecting with ``Last-Event-ID`` whenever a
    connection ends early; connection ``n`` goes to ``urls[n % len(urls)]``. ``stop_after_blocks``:
    drop the first connection after that many ``delta`` events (a client that goes away)."""
    followed = into or FollowedStream()
    last_event_id = last_event_id or followed.last_id
    deadline = time.monotonic() + timeout
    while followed.result is None and time.monotonic() < deadline:
        url = urls[followed.connections % len(urls)]
        followed.connections += 1
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        with httpx.stream("GET", f"{url}/v1/jobs/{job_id}/events", headers=headers, timeout=30.0) as response:
            assert response.status_code == 200, (response.status_code, response.read())
            deltas = 0
            for event_id, name, data in sse_events(response):
                if name == ":":
                    followed.stopping_notes += "replica stopping" in data
                    continue
                followed.events.append((event_id, name, data))
                last_event_id = event_id or last_event_id
                deltas += name == "delta"
                if stop_after_blocks is not None and deltas >= stop_after_blocks:
                    return followed
    return followed
