"""``python -m bench.api``: the submit path against a bare FastAPI endpoint, in the same run.

Measures, on the same database and Redis:

1. submit throughput and p50/p99 latency at 1, 16 and 64 concurrent clients:
   cloverq's ``POST /v1/jobs`` (auth on, validation, routing, admission, SQL insert, Celery
   publish) vs. ``bench.bare_api``'s endpoint doing one SQL insert + one Redis push;
2. poll throughput: ``GET /v1/jobs/{id}`` vs. the bare one-row SELECT;
3. per-job overhead with a real worker on the tiny demo model: end-to-end time minus the
   engine's own time (sequential jobs; client-observed with long polling and with fast polling,
   and server-side from the job's timestamps).

``--tracing`` measures instead what OpenTelemetry tracing costs the submit path (issue 29): one
API process (``bench.tracing_switch``) switched between tracing off, on at sample ratio 0.1 and on
at 1.0 (exporting over OTLP/HTTP to ``bench.otlp_sink``, a stand-in collector in its own process),
in blocks whose order rotates round by round, with a second tracing-off block per round as an A/A
control; throughput, latency and server CPU per request against tracing off. Goals: <= 3% loss at
0.1, <= 10% at 1.0. Use ``--rounds`` 8 or more (a multiple of 4 puts each setup in each place).

Backends: ``--database-url`` / ``--redis-url``, defaulting to ``CLOVERQ_TEST_DATABASE_URL`` /
``CLOVERQ_TEST_REDIS_URL`` (as in CI: PostgreSQL gets a fresh database that is dropped at
the end; the Redis DB is flushed), else a SQLite file and an embedded redis-server.
Goals (issue 4, 2-core machine, PostgreSQL): submit >= 70% of the bare throughput, submit
p99 <= 25 ms at 64 clients, overhead p50 <= 15 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import httpx

from bench.backends import HOST, free_port, scratch_database, scratch_redis
from bench.http_load import LoadResult, build_request, run_load
from cli.supervisor import _die_with_parent
from scheduler.infra.queue_names import JOB_QUEUES
from scheduler.infra.settings import available_cpus
from scheduler.jobs.models import JobStatus

JOB_TIMEOUT_SECONDS = 60.0

SUBMIT_BODY = json.dumps(
    {"kind": "generate", "input": {"prompt": "The quick brown fox"}, "params": {"max_new_tokens": 16}}
).encode()
BIG_LIMITS = dict.fromkeys(JOB_QUEUES, 10**9)


# --- backends -----------------------------------------------------------------------------------


class Service:
    """A subprocess serving HTTP or consuming jobs; stopped with its process group."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent)

    def wait_http(self, url: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log_path.read_text()[-3000:]}")
            with suppress(httpx.HTTPError):
                httpx.get(url, timeout=1.0)
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not answer at {url}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)


# --- measurements -------------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _load(service: Service, port: int, make: Callable[[int, int], bytes], clients: int, total: int,
          keep_bodies: bool = False, rate: float | None = None) -> LoadResult:
    """Run the load; also record the server's CPU milliseconds per request (load-independent)."""
    per_client = max(1, total // clients)
    cpu_before = _cpu_seconds(service.proc.pid)
    result = asyncio.run(run_load(HOST, port, make, clients=clients, requests_per_client=per_client,
                                  keep_bodies=keep_bodies, rate=rate))
    result.server_cpu_ms = (_cpu_seconds(service.proc.pid) - cpu_before) * 1000.0 / max(1, result.requests)
    return result


def _row(label: str, real: LoadResult, bare: LoadResult) -> str:
    ratio = real.throughput / bare.throughput if bare.throughput else float("nan")
    return (f"{label:<22} {real.throughput:9.0f} {bare.throughput:9.0f} {ratio:7.2f}   "
            f"{real.percentile(50):7.2f} {real.percentile(99):7.2f}   "
            f"{bare.percentile(50):7.2f} {bare.percentile(99):7.2f}   "
            f"{real.server_cpu_ms:6.2f} {bare.server_cpu_ms:6.2f}   {_statuses(real)}")


def _statuses(result: LoadResult) -> str:
    return ",".join(f"{code}x{count}" for code, count in sorted(result.statuses.items()))


def _overhead(api_url: str, headers: dict[str, str], jobs: int) -> dict[str, list[float]]:
    """Overheads in ms for ``jobs`` sequential jobs: end to end minus engine time, as a client
    sees it (long polling: ``GET ?wait=30`` right after the submit; and polling every 2 ms, a
    client without long polling whose polls also compete for the CPU) and server-side, split into
    pickup (created -> claimed) and the worker's own share (run time minus engine time)."""
    rows: dict[str, list[float]] = {
        "client-observed (long poll ?wait=30)": [], "client-observed (2 ms polling)": [],
        "server-side (created->finished)": [], "  of which pickup (created->claimed)": [],
        "  of which worker (run - engine)": [],
    }
    body = {"kind": "generate", "input": {"prompt": "Hello"}, "params": {"max_new_tokens": 8}}
    with httpx.Client(base_url=api_url, headers=headers, timeout=60.0) as client:
        for n in range(2 * jobs):
            long_poll = n % 2 == 0  # alternate the two client styles
            started = time.perf_counter()
            job = client.post("/v1/jobs", json=body).json()
            deadline = time.monotonic() + JOB_TIMEOUT_SECONDS
            while job["status"] in (JobStatus.QUEUED, JobStatus.RUNNING):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"job {job['id']} did not finish in {JOB_TIMEOUT_SECONDS}s: {job}")
                if long_poll:
                    job = client.get(f"/v1/jobs/{job['id']}", params={"wait": 30}).json()
                else:
                    time.sleep(0.002)
                    job = client.get(f"/v1/jobs/{job['id']}").json()
            elapsed_ms = (time.perf_counter() - started) * 1000.0
            if job["status"] != JobStatus.SUCCEEDED:
                raise RuntimeError(f"job did not succeed: {job}")
            timings = job["timings"]
            engine_ms = (timings["engine_run_ms"] or 0.0) + (timings["engine_queue_ms"] or 0.0)
            style = "long poll ?wait=30" if long_poll else "2 ms polling"
            rows[f"client-observed ({style})"].append(elapsed_ms - engine_ms)
            if long_poll:  # server-side figures of the undisturbed (long-polled) jobs
                rows["server-side (created->finished)"].append(timings["total_ms"] - engine_ms)
                rows["  of which pickup (created->claimed)"].append(timings["queued_ms"])
                rows["  of which worker (run - engine)"].append(timings["run_ms"] - engine_ms)
    return rows


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--database-url", default=os.environ.get("CLOVERQ_TEST_DATABASE_URL"))
    parser.add_argument("--redis-url", default=os.environ.get("CLOVERQ_TEST_REDIS_URL"))
    parser.add_argument("--clients", default="1,16,64")
    parser.add_argument("--requests", type=int, default=3000, help="Submits per concurrency level.")
    parser.add_argument(
        "--rounds", type=int, default=3,
        help="Each level's requests are split into this many bare/real rounds, alternated, so a "
             "burst of background load hits both sides alike; figures are over all rounds.",
    )
    parser.add_argument("--auth", choices=["enabled", "disabled"], default="enabled")
    parser.add_argument("--overhead-jobs", type=int, default=30, help="0 skips the worker phase.")
    parser.add_argument("--tracing", action="store_true",
                        help="Only the tracing comparison: submit with tracing off / ratio 0.1 / ratio 1.0.")
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the finally blocks stop every server and drop the database.
    signal.signal(signal.SIGTERM, _interrupt)
    levels = [int(c) for c in args.clients.split(",")]

    with tempfile.TemporaryDirectory(prefix="cloverq-bench-") as tmp:
        workdir = Path(tmp)
        with (
            scratch_database(args.database_url, workdir, prefix="bench") as db_url,
            scratch_redis(args.redis_url, workdir) as redis_url,
        ):
            if args.tracing:
                _run_tracing(args, levels, workdir, db_url, redis_url)
            else:
                _run(args, levels, workdir, db_url, redis_url)


def _run(args: argparse.Namespace, levels: list[int], workdir: Path, db_url: str, redis_url: str) -> None:
    import redis
    from sqlalchemy import text, update

    from scheduler.access.api_keys import create_key
    from scheduler.infra.db import make_engine, migrate, session_factory
    from scheduler.jobs.models import Job
    from worker.model.demo import write_demo_checkpoint

    migrate(db_url)
    model_dir = write_demo_checkpoint(workdir / "model", seed=0, size="tiny")
    env = {
        **os.environ,
        "CLOVERQ_DATABASE_URL": db_url, "CLOVERQ_REDIS_URL": redis_url,
        "CLOVERQ_DATA_DIR": str(workdir / "data"), "CLOVERQ_MODEL_DIR": str(model_dir),
        "CLOVERQ_AUTH": args.auth, "CLOVERQ_RATE_LIMIT_PER_SECOND": "0",
        "CLOVERQ_TENANT_MAX_ACTIVE_JOBS": str(10**9), "CLOVERQ_QUEUE_MAX_DEPTH": json.dumps(BIG_LIMITS),
        "CLOVERQ_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
    }
    engine = make_engine(db_url)
    headers: dict[str, str] = {}
    if args.auth == "enabled":
        with session_factory(engine)() as session:
            key = create_key(session, tenant="bench", scopes=frozenset({"submit", "read"})).key
        headers = {"Authorization": f"Bearer {key}"}

    real_port, bare_port = free_port(), free_port()
    python = sys.executable
    real = Service("api", [python, "-m", "cli", "api", "--port", str(real_port)], env, workdir)
    bare = Service("bare", [python, "-m", "bench.bare_api", "--port", str(bare_port)], env, workdir)
    services = [real, bare]
    try:
        real.wait_http(f"http://{HOST}:{real_port}/healthz")
        bare.wait_http(f"http://{HOST}:{bare_port}/docs")
        host_real, host_bare = f"{HOST}:{real_port}", f"{HOST}:{bare_port}"
        submit_real = build_request("POST", "/v1/jobs", host_real, SUBMIT_BODY, headers)
        submit_bare = build_request("POST", "/bare/jobs", host_bare, SUBMIT_BODY)
        _load(real, real_port, lambda i, n: submit_real, 8, 400)  # warm-up: pools, caches, JIT-free paths
        _load(bare, bare_port, lambda i, n: submit_bare, 8, 400)

        db_kind = "PostgreSQL" if db_url.startswith("postgresql") else "SQLite"
        print(f"\nbench.api — {db_kind}, Redis {redis_url}, auth {args.auth}, {available_cpus()} CPUs")
        print(f"{'':<22} {'req/s':>9} {'bare':>9} {'ratio':>7}   {'p50 ms':>7} {'p99 ms':>7}   "
              f"{'bare50':>7} {'bare99':>7}   {'cpu ms':>6} {'bare':>6}   statuses")
        ids: list[str] = []
        for clients in levels:
            bare_parts, real_parts = [], []
            for _ in range(max(1, args.rounds)):
                share = max(clients, args.requests // max(1, args.rounds))
                bare_parts.append(_load(bare, bare_port, lambda i, n: submit_bare, clients, share))
                real_parts.append(_load(real, real_port, lambda i, n: submit_real, clients, share,
                                        keep_bodies=True))
            bare_result, real_result = LoadResult.merged(bare_parts), LoadResult.merged(real_parts)
            ids += [json.loads(body)["id"] for body in real_result.bodies[:200]]
            print(_row(f"submit x{clients}", real_result, bare_result))
            saturated = real_result.throughput
        # Closed-loop latency at saturation is queueing (Little's law: 64 clients / throughput).
        # Latency at a given load: 64 paced clients offering half the real API's capacity.
        # Each round is 10 s per side: a stall of the shared machine (a checkpoint, autovacuum)
        # lasting ~150 ms delays ~20 requests, which is the whole p99 of one 10 s window.
        paced = max(1.0, round(saturated * 0.5))
        bare_parts, real_parts = [], []
        per_round = int(paced * 10)
        for _ in range(max(1, args.rounds)):
            bare_parts.append(_load(bare, bare_port, lambda i, n: submit_bare, 64, per_round, rate=paced))
            real_parts.append(_load(real, real_port, lambda i, n: submit_real, 64, per_round, rate=paced))
        bare_result, real_result = LoadResult.merged(bare_parts), LoadResult.merged(real_parts)
        print(_row(f"submit x64 @{paced:.0f}/s", real_result, bare_result))

        bare_ids = [str(row[0]) for row in engine.connect().execute(
            text("SELECT id FROM jobs WHERE tenant = 'bench' ORDER BY created_at DESC LIMIT 200"))]
        poll_real = [build_request("GET", f"/v1/jobs/{job_id}", host_real, b"", headers) for job_id in ids]
        poll_bare = [build_request("GET", f"/bare/jobs/{job_id}", host_bare) for job_id in bare_ids]

        def pick_real(i: int, n: int) -> bytes:
            return poll_real[(i * 31 + n) % len(poll_real)]

        def pick_bare(i: int, n: int) -> bytes:
            return poll_bare[(i * 31 + n) % len(poll_bare)]

        for clients in (16, 64):
            bare_parts, real_parts = [], []
            for _ in range(max(1, args.rounds)):
                share = max(clients, 2 * args.requests // max(1, args.rounds))
                bare_parts.append(_load(bare, bare_port, pick_bare, clients, share))
                real_parts.append(_load(real, real_port, pick_real, clients, share))
            bare_result, real_result = LoadResult.merged(bare_parts), LoadResult.merged(real_parts)
            print(_row(f"poll x{clients}", real_result, bare_result))

        if args.overhead_jobs > 0:
            # Drop the backlog the throughput phase queued so the worker sees only our jobs.
            redis.Redis.from_url(redis_url).flushdb()
            with session_factory(engine)() as session:
                session.execute(update(Job).where(Job.status == JobStatus.QUEUED.value)
                                .values(status=JobStatus.CANCELLED.value))
                session.commit()
            worker = Service("worker", [python, "-m", "cli", "worker"], env, workdir)
            services.append(worker)
            _wait_worker(redis_url, worker)
            api_url = f"http://{host_real}"
            _overhead(api_url, headers, 3)  # warm-up
            overheads = _overhead(api_url, headers, args.overhead_jobs)
            print(f"\nper-job overhead (end-to-end minus engine time), {args.overhead_jobs} sequential jobs "
                  "per client style:")
            for label, values in overheads.items():
                print(f"  {label:<38} p50 {_pct(values, 50):7.2f} ms  p99 {_pct(values, 99):7.2f} ms  "
                      f"mean {statistics.fmean(values):7.2f} ms")
        print("\ngoals: submit ratio >= 0.70, submit p99 <= 25 ms at 64 clients (PostgreSQL), "
              "overhead p50 <= 15 ms")
    finally:
        for service in reversed(services):
            service.stop()
        engine.dispose()


# (label, setup of bench.tracing_switch). "off again" is a second tracing-off block in each round:
# its distance from "tracing off" is the noise that is left (an A/A control).
TRACING_SETUPS: tuple[tuple[str, str], ...] = (
    ("tracing off", "off"), ("tracing 0.1", "0.1"), ("tracing 1.0", "1.0"), ("1.0, step spans", "1.0-steps"),
    ("off again A-A", "off"),
)


def rotated(items: list[Any], round_: int) -> list[Any]:
    """``items`` starting at ``round_`` (mod len): each setup takes each place in the order in
    turn, so a trend over the run (tables and queues growing, a background burst) does not
    always land on the same setup."""
    shift = round_ % len(items) if items else 0
    return items[shift:] + items[:shift]


def _control(port: int, line: str) -> str:
    """One control line to bench.tracing_switch; it answers once the change is made (``ok``, and
    for ``cpu`` the export threads' CPU seconds: returned)."""
    import socket

    with socket.create_connection((HOST, port), timeout=30) as conn:
        conn.sendall(line.encode() + b"\n")
        reply = conn.makefile().readline().strip()
    if reply.split(" ", 1)[0] != "ok":
        raise RuntimeError(f"tracing switch answered {reply!r} to {line!r}")
    return reply[3:]


def _run_tracing(args: argparse.Namespace, levels: list[int], workdir: Path, db_url: str,
                 redis_url: str) -> None:
    """Submit throughput and server CPU per request with tracing off, at ratio 0.1 and at 1.0, in
    ONE API process whose tracing setup is switched between blocks (bench.tracing_switch: two
    identical API processes differ by more than the effect measured here), in rounds whose order
    rotates; each block's queued spans are exported before its CPU time is read."""
    from scheduler.access.api_keys import create_key
    from scheduler.infra.db import make_engine, migrate, session_factory
    from worker.model.demo import write_demo_checkpoint

    migrate(db_url)
    model_dir = write_demo_checkpoint(workdir / "model", seed=0, size="tiny")
    sink_port, port, control_port = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "CLOVERQ_DATABASE_URL": db_url, "CLOVERQ_REDIS_URL": redis_url,
        "CLOVERQ_DATA_DIR": str(workdir / "data"), "CLOVERQ_MODEL_DIR": str(model_dir),
        "CLOVERQ_AUTH": args.auth, "CLOVERQ_RATE_LIMIT_PER_SECOND": "0",
        "CLOVERQ_TENANT_MAX_ACTIVE_JOBS": str(10**9), "CLOVERQ_QUEUE_MAX_DEPTH": json.dumps(BIG_LIMITS),
        "CLOVERQ_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1", "CLOVERQ_TRACING_ENABLED": "false",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{HOST}:{sink_port}",
    }
    engine = make_engine(db_url)
    headers: dict[str, str] = {}
    if args.auth == "enabled":
        with session_factory(engine)() as session:
            key = create_key(session, tenant="bench", scopes=frozenset({"submit", "read"})).key
        headers = {"Authorization": f"Bearer {key}"}
    engine.dispose()
    python = sys.executable
    sink = Service("otlp-sink", [python, "-m", "bench.otlp_sink", "--port", str(sink_port)], env, workdir)
    api = Service("api-switch", [python, "-m", "bench.tracing_switch", "--port", str(port),
                                 "--control-port", str(control_port)], env, workdir)
    request = build_request("POST", "/v1/jobs", f"{HOST}:{port}", SUBMIT_BODY, headers)
    export_ms: dict[str, list[float]] = {setup: [] for _, setup in TRACING_SETUPS}  # per block

    def block(setup: str, clients: int, total: int) -> LoadResult:
        _control(control_port, f"use {setup}")
        per_client = max(1, total // clients)
        cpu_before, export_before = _cpu_seconds(api.proc.pid), float(_control(control_port, "cpu"))
        result = asyncio.run(run_load(HOST, port, lambda i, n: request, clients=clients,
                                      requests_per_client=per_client))
        _control(control_port, "flush")  # this block's spans exported: their CPU counted here
        requests = max(1, result.requests)
        result.server_cpu_ms = (_cpu_seconds(api.proc.pid) - cpu_before) * 1000.0 / requests
        export_ms[setup].append((float(_control(control_port, "cpu")) - export_before) * 1000.0 / requests)
        return result

    try:
        sink.wait_http(f"http://{HOST}:{sink_port}/")
        api.wait_http(f"http://{HOST}:{port}/healthz")
        for _, setup in TRACING_SETUPS:  # warm-up
            block(setup, 8, 400)
        rounds = max(1, args.rounds)
        db_kind = "PostgreSQL" if db_url.startswith("postgresql") else "SQLite"
        print(f"\nbench.api --tracing — {db_kind}, Redis {redis_url}, auth {args.auth}, "
              f"{available_cpus()} CPUs, one API process switched between setups, {rounds} rounds")
        print(f"{'':<22} {'req/s':>7} {'vs off':>7} {'(rounds min-max)':>17}   {'p50 ms':>7} {'p99 ms':>7}"
              f"   {'cpu ms':>6} {'vs off':>7} {'export':>6}   statuses")
        for clients in levels:
            parts: dict[str, list[LoadResult]] = {label: [] for label, _ in TRACING_SETUPS}
            share = max(clients, args.requests // rounds)
            exported: dict[str, list[float]] = {label: [] for label, _ in TRACING_SETUPS}
            for round_ in range(rounds):
                for label, setup in rotated(list(TRACING_SETUPS), round_):
                    parts[label].append(block(setup, clients, share))
                    exported[label].append(export_ms[setup][-1] * parts[label][-1].requests)
            merged = {label: LoadResult.merged(results) for label, results in parts.items()}
            off = merged[TRACING_SETUPS[0][0]]
            for label, result in merged.items():
                per_round = [part.throughput / base.throughput
                             for part, base in zip(parts[label], parts[TRACING_SETUPS[0][0]], strict=True)]
                print(f"{label + f' x{clients}':<22} {result.throughput:7.0f} "
                      f"{result.throughput / off.throughput:7.3f} "
                      f"{f'({min(per_round):.3f}-{max(per_round):.3f})':>17}   "
                      f"{result.percentile(50):7.2f} {result.percentile(99):7.2f}   "
                      f"{result.server_cpu_ms:6.2f} {off.server_cpu_ms / result.server_cpu_ms:7.3f} "
                      f"{sum(exported[label]) / max(1, result.requests):6.3f}   "
                      f"{_statuses(result)}")
        print("\ngoals: throughput loss <= 3% at ratio 0.1, <= 10% at ratio 1.0 (vs tracing off). "
              "'cpu ms vs off' is off's CPU per request over this one's (the throughput ratio if the "
              "API's CPU is the bottleneck); 'export' is the part of 'cpu ms' spent in the span export "
              "thread (encoding and posting to the collector); '1.0, step spans' is ratio 1.0 with "
              "CLOVERQ_TRACING_STEP_SPANS=true (the submit's admission, SQL commit and publish as child "
              "spans, not events: not the default); 'off again A-A' is a second tracing-off "
              "block per round: its distance from 1.000 is the noise that is left.")
    finally:
        api.stop()
        sink.stop()


def _wait_worker(redis_url: str, worker: Service, timeout: float = 120.0) -> None:
    import redis

    from scheduler.fleet.workers import ready_workers

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker.proc.poll() is not None:
            raise RuntimeError(f"worker exited:\n{worker.log_path.read_text()[-3000:]}")
        if ready_workers(client):
            return
        time.sleep(0.2)
    raise RuntimeError("worker not ready in time")


if __name__ == "__main__":
    main()
