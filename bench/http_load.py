"""A minimal closed-loop HTTP/1.1 load generator (asyncio, keep-alive, raw sockets).

Written for the benchmarks rather than using httpx: on a 2-core machine the client shares the
CPU with the server under test, and a heavyweight client would measure itself. Each virtual
client holds one keep-alive connection and sends its next request as soon as the previous
answer is read (closed loop), so concurrency equals the number of clients.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class LoadResult:
    """Latencies (seconds) and status counts of one run."""

    clients: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    bodies: list[bytes] = field(default_factory=list)
    server_cpu_ms: float = float("nan")  # server CPU per request, when the caller measures it

    @property
    def requests(self) -> int:
        return len(self.latencies)

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    def percentile(self, q: float) -> float:
        """Latency percentile ``q`` in [0, 100], in milliseconds."""
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        index = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
        return ordered[index] * 1000.0

    @classmethod
    def merged(cls, parts: list[LoadResult]) -> LoadResult:
        """One result for several runs of the same load: their requests over their summed time."""
        total = cls(clients=parts[0].clients, seconds=sum(part.seconds for part in parts))
        for part in parts:
            total.latencies += part.latencies
            total.bodies += part.bodies
            for status, count in part.statuses.items():
                total.statuses[status] = total.statuses.get(status, 0) + count
        requests = sum(part.requests for part in parts)
        total.server_cpu_ms = sum(part.server_cpu_ms * part.requests for part in parts) / max(1, requests)
        return total

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.latencies) * 1000.0 if self.latencies else float("nan")


def build_request(method: str, path: str, host: str, body: bytes = b"",
                  headers: dict[str, str] | None = None) -> bytes:
    """Raw HTTP/1.1 request bytes (keep-alive)."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: keep-alive"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append("Content-Type: application/json")
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    chunked = False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        lowered = name.strip().lower()
        if lowered == b"content-length":
            length = int(value.strip())
        elif lowered == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if not chunked:
        return status, await reader.readexactly(length) if length else b""
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return status, b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


async def run_load(
    host: str,
    port: int,
    make_request: Callable[[int, int], bytes],
    *,
    clients: int,
    requests_per_client: int,
    keep_bodies: bool = False,
    rate: float | None = None,
) -> LoadResult:
    """``clients`` connections each sending ``requests_per_client`` requests.

    Closed loop (``rate=None``): back to back, so latency includes queueing at saturation.
    Paced (``rate`` requests/s in total): each client sends on a fixed schedule (open loop
    while the server keeps up), which measures latency at a given offered load.
    ``make_request(client_index, request_index)`` returns the raw request bytes.
    """
    result = LoadResult(clients=clients, seconds=0.0)
    connections = await asyncio.gather(*(asyncio.open_connection(host, port) for _ in range(clients)))
    started = time.perf_counter()  # every connection is open before the clock starts

    period = clients / rate if rate else 0.0

    async def client(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = started + period * index / clients  # spread the clients over one period
        try:
            for n in range(requests_per_client):
                if period:
                    delay = first + n * period - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                payload = make_request(index, n)
                sent = time.perf_counter()
                writer.write(payload)
                status, body = await _read_response(reader)
                result.latencies.append(time.perf_counter() - sent)
                result.statuses[status] = result.statuses.get(status, 0) + 1
                if keep_bodies:
                    result.bodies.append(body)
        finally:
            writer.close()

    await asyncio.gather(*(client(i, r, w) for i, (r, w) in enumerate(connections)))
    result.seconds = time.perf_counter() - started
    return result
