"""Soak: many clients submit and poll for minutes; nothing may fail, get lost or grow.

``python -m bench.soak [--minutes 20] [--clients 64]`` starts the embedded stack as the README
does (``cloverq up`` in a temp dir, auth off so no key's rate limit caps the load; pass
``CLOVERQ_DATABASE_URL`` / ``CLOVERQ_REDIS_URL`` to soak PostgreSQL and a real Redis), then runs
``--clients`` closed-loop HTTP clients (httpx async, loopback): each submits a tiny generate
job, polls it until it is final, and submits the next. It prints requests, errors (5xx
separately), lost jobs (accepted but never final), p50/p99 latency of submits and polls, jobs
per second, and the RSS of the API and worker processes after warm-up and at the end.

``run_load`` is the reusable part: ``tests/chaos/test_chaos_load.py`` runs it for two minutes
against the chaos stack and asserts the same figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from bench.fleet_services import free_port
from scheduler.jobs import models

FINAL_STATUSES = frozenset(status.value for status in models.FINAL_STATUSES)
TINY_JOB = {"kind": "generate", "input": {"prompt": "Soak test"},
            "params": {"max_new_tokens": 4, "steps_per_block": 1, "seed": 1}}


@dataclass
class RssSample:
    at: float  # seconds since the load started
    rss: dict[str, int]  # process label -> bytes


@dataclass
class SoakReport:
    """What one soak run saw."""

    clients: int
    seconds: float
    warmup_seconds: float
    submit_latencies: list[float] = field(default_factory=list)
    poll_latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    transport_errors: int = 0
    transport_error_kinds: dict[str, int] = field(default_factory=dict)  # "Type: message" -> count
    accepted: set[str] = field(default_factory=set)
    finished: dict[str, str] = field(default_factory=dict)  # job id -> final status
    rss: list[RssSample] = field(default_factory=list)

    def record_transport_error(self, method: str, error: httpx.HTTPError) -> None:
        self.transport_errors += 1
        kind = f"{method} {type(error).__name__}: {error}"
        self.transport_error_kinds[kind] = self.transport_error_kinds.get(kind, 0) + 1

    @property
    def requests(self) -> int:
        return len(self.submit_latencies) + len(self.poll_latencies)

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    @property
    def errors(self) -> int:
        """Transport errors and every answer that is not 2xx."""
        return self.transport_errors + sum(n for status, n in self.statuses.items() if status >= 300)

    @property
    def lost(self) -> set[str]:
        return self.accepted - set(self.finished)

    @property
    def not_succeeded(self) -> dict[str, str]:
        return {job: status for job, status in self.finished.items() if status != models.JobStatus.SUCCEEDED}

    def rss_at_warmup(self) -> dict[str, int]:
        after = [s for s in self.rss if s.at >= self.warmup_seconds]
        return (after[0] if after else self.rss[-1]).rss

    def rss_at_end(self) -> dict[str, int]:
        return self.rss[-1].rss

    def rss_growth(self) -> dict[str, float]:
        """Relative RSS growth of each process from the end of warm-up to the end."""
        start, end = self.rss_at_warmup(), self.rss_at_end()
        return {name: (end[name] - start[name]) / start[name] for name in start if name in end}

    def summary(self) -> str:
        lines = [
            f"clients {self.clients}, {self.seconds:.0f} s (warm-up {self.warmup_seconds:.0f} s)",
            f"requests {self.requests} ({self.requests / self.seconds:.0f}/s): "
            f"submits {len(self.submit_latencies)}, polls {len(self.poll_latencies)}",
            f"errors {self.errors} (5xx {self.server_errors}, transport {self.transport_errors}); "
            f"statuses {dict(sorted(self.statuses.items()))}",
            *(f"  transport error x{n}: {kind}" for kind, n in sorted(self.transport_error_kinds.items())),
            f"jobs accepted {len(self.accepted)}, finished {len(self.finished)} "
            f"({len(self.finished) / self.seconds:.1f}/s), not succeeded {len(self.not_succeeded)}, "
            f"lost {len(self.lost)}",
            f"latency submit p50 {percentile(self.submit_latencies, 50):.1f} ms "
            f"p99 {percentile(self.submit_latencies, 99):.1f} ms; "
            f"poll p50 {percentile(self.poll_latencies, 50):.1f} ms "
            f"p99 {percentile(self.poll_latencies, 99):.1f} ms",
        ]
        if self.rss:
            start, end, growth = self.rss_at_warmup(), self.rss_at_end(), self.rss_growth()
            for name in sorted(start):
                lines.append(f"RSS {name}: first {self.rss[0].rss.get(name, 0) / 2**20:.1f} MiB, "
                             f"after warm-up {start[name] / 2**20:.1f} MiB, "
                             f"end {end.get(name, 0) / 2**20:.1f} MiB ({growth.get(name, 0) * 100:+.2f}%)")
        return "\n".join(lines)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` of ``values`` (seconds) in milliseconds."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))] * 1000


def sample_rss(pids: dict[str, int]) -> dict[str, int]:
    """Resident set size of each labelled process (bytes); a vanished process is left out."""
    out: dict[str, int] = {}
    for name, pid in pids.items():
        try:
            out[name] = psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return out


async def _client_loop(http: httpx.AsyncClient, report: SoakReport, stop_at: float,
                       poll_interval: float, body: dict[str, object]) -> None:
    while time.monotonic() < stop_at:
        began = time.monotonic()
        try:
            response = await http.post("/v1/jobs", json=body)
        except httpx.HTTPError as error:
            report.record_transport_error("POST", error)
            await asyncio.sleep(poll_interval)
            continue
        report.submit_latencies.append(time.monotonic() - began)
        report.statuses[response.status_code] = report.statuses.get(response.status_code, 0) + 1
        if response.status_code != 202:
            await asyncio.sleep(poll_interval)
            continue
        job_id = str(response.json()["id"])
        report.accepted.add(job_id)
        while time.monotonic() < stop_at:
            await asyncio.sleep(poll_interval)
            began = time.monotonic()
            try:
                polled = await http.get(f"/v1/jobs/{job_id}")
            except httpx.HTTPError as error:
                report.record_transport_error("GET", error)
                continue
            report.poll_latencies.append(time.monotonic() - began)
            report.statuses[polled.status_code] = report.statuses.get(polled.status_code, 0) + 1
            status = polled.json().get("status") if polled.status_code == 200 else None
            if status in FINAL_STATUSES:
                report.finished[job_id] = str(status)
                break


async def _sample_rss_loop(report: SoakReport, pids: Callable[[], dict[str, int]], began: float,
                           stop_at: float, every: float) -> None:
    while True:
        report.rss.append(RssSample(time.monotonic() - began, sample_rss(pids())))
        if time.monotonic() >= stop_at:
            return
        await asyncio.sleep(min(every, max(0.0, stop_at - time.monotonic())))


async def _settle(http: httpx.AsyncClient, report: SoakReport, timeout: float) -> None:
    """After the load: wait for every accepted job that was still running to become final."""
    deadline = time.monotonic() + timeout
    while report.lost and time.monotonic() < deadline:
        for job_id in list(report.lost):
            try:
                response = await http.get(f"/v1/jobs/{job_id}")
            except httpx.HTTPError:
                continue
            status = response.json().get("status") if response.status_code == 200 else None
            if status in FINAL_STATUSES:
                report.finished[job_id] = str(status)
        await asyncio.sleep(0.5)


async def _run_load(base_url: str, *, clients: int, seconds: float, warmup_seconds: float,
                    pids: Callable[[], dict[str, int]], poll_interval: float, rss_every: float,
                    settle_seconds: float, body: dict[str, object], headers: dict[str, str]) -> SoakReport:
    report = SoakReport(clients=clients, seconds=seconds, warmup_seconds=warmup_seconds)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=30.0, headers=headers) as http:
        began = time.monotonic()
        stop_at = began + seconds
        sampler = asyncio.create_task(_sample_rss_loop(report, pids, began, stop_at, rss_every))
        await asyncio.gather(*(_client_loop(http, report, stop_at, poll_interval, body)
                               for _ in range(clients)))
        await sampler
        await _settle(http, report, settle_seconds)
    return report


def run_load(base_url: str, *, clients: int = 64, seconds: float = 120.0, warmup_seconds: float = 30.0,
             pids: Callable[[], dict[str, int]] = dict, poll_interval: float = 0.25,
             rss_every: float = 5.0, settle_seconds: float = 60.0,
             body: dict[str, object] | None = None, headers: dict[str, str] | None = None) -> SoakReport:
    """``clients`` closed-loop clients for ``seconds``; RSS of ``pids()`` sampled every ``rss_every``."""
    return asyncio.run(_run_load(
        base_url, clients=clients, seconds=seconds, warmup_seconds=warmup_seconds, pids=pids,
        poll_interval=poll_interval, rss_every=rss_every, settle_seconds=settle_seconds,
        body=body or TINY_JOB, headers=headers or {},
    ))


# --- the stand-alone bench: `cloverq up` in a temp dir ---------------------------------------------


def _stack_pids(up: subprocess.Popen[bytes]) -> dict[str, int]:
    """API and worker processes among ``cloverq up``'s children (by their command lines)."""
    pids: dict[str, int] = {}
    try:
        children = psutil.Process(up.pid).children(recursive=True)
    except psutil.Error:
        return pids
    for child in children:
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        command = argv[3] if len(argv) > 3 and argv[1:3] == ["-m", "cli"] else None  # python -m cli X
        if command in ("api", "worker"):
            pids.setdefault(command, child.pid)
    return pids


def _wait_ready(base_url: str, up: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise SystemExit(f"cloverq up exited with {up.returncode}")
        try:
            if httpx.get(base_url + "/readyz", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the stack did not become ready in time")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0, help="load duration (default 20)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--warmup-minutes", type=float, default=None,
                        help="RSS baseline taken after this (default: a tenth of the run, 30 s to 2 min)")
    parser.add_argument("--poll-interval", type=float, default=0.25, help="seconds between polls of a job")
    args = parser.parse_args(argv)
    seconds = args.minutes * 60
    warmup = min(120.0, max(30.0, seconds / 10))
    if args.warmup_minutes is not None:
        warmup = args.warmup_minutes * 60

    workdir = Path(tempfile.mkdtemp(prefix="cloverq-soak-"))
    port = free_port()
    env = {**os.environ, "CLOVERQ_DATA_DIR": str(workdir), "CLOVERQ_AUTH": "disabled",
           "CLOVERQ_EMBEDDED_REDIS_PORT": str(free_port()), "CLOVERQ_LOG_LEVEL": "WARNING",
           "CLOVERQ_TENANT_MAX_ACTIVE_JOBS": "100000"}
    log_path = workdir / "up.log"
    print(f"starting cloverq up on port {port} (state and logs in {workdir}) ...", flush=True)
    with log_path.open("wb") as log_file:
        up = subprocess.Popen([sys.executable, "-m", "cli", "up", "--port", str(port)], env=env,
                              stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base_url, up, timeout=300)
        pids = _stack_pids(up)
        print(f"ready; processes {pids}; {args.clients} clients for {args.minutes:g} min ...", flush=True)
        report = run_load(base_url, clients=args.clients, seconds=seconds, warmup_seconds=warmup,
                          pids=lambda: pids, poll_interval=args.poll_interval, rss_every=10.0)
        print(report.summary())
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
