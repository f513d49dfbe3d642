"""``cloverq probe worker``: liveness / readiness of the worker on this host, for exec probes.

A Celery worker serves no HTTP, so Kubernetes (and Docker health checks) cannot ``GET
/healthz`` it. The worker already publishes itself in the Redis worker registry (state and a
heartbeat with a TTL, ``scheduler.fleet.workers``); this command reads that entry for the local
hostname (a pod's hostname is its name), so the probe sees exactly what ``/readyz`` and the
admin API see.

* ``--ready``: exit 0 only if a worker on this host is ``ready`` (model loaded and warmed up; for a
  tensor-parallel worker, every rank: ``stats.tensor_parallel.ranks_ready == size``).
* liveness (default): exit 0 if a worker on this host still heartbeats (any state but
  ``stopped``), and also when Redis itself cannot be reached: a Redis outage must not make the
  kubelet restart every worker (and reload every model) at once; readiness still fails then.
"""

from __future__ import annotations

import socket
import sys

import click
import redis

from scheduler.fleet.workers import WorkerInfo, WorkerState, list_workers
from scheduler.infra.redis_client import get_redis
from scheduler.infra.settings import get_settings


@click.group("probe")
def probe_group() -> None:
    """Health probes for processes that serve no HTTP (exit status 0 = healthy)."""


@probe_group.command("worker")
@click.option("--ready", "check_ready", is_flag=True, help="Readiness: the worker is ready to take jobs.")
@click.option("--hostname", default=None, help="Host whose worker to check (default: this host).")
def worker_probe(check_ready: bool, hostname: str | None) -> None:
    """Check the worker running on this host through the Redis worker registry."""
    host = hostname or socket.gethostname()
    try:
        registry = list_workers(get_redis(get_settings().resolved_redis_url))
        workers = [w for w in registry if w.hostname == host]
    except redis.RedisError as exc:
        click.echo(f"redis unreachable: {type(exc).__name__}: {exc}", err=True)
        sys.exit(1 if check_ready else 0)
    states = sorted({w.state for w in workers})
    if check_ready:
        healthy = any(w.is_ready and all_ranks_ready(w) for w in workers)
    else:
        healthy = any(w.state != WorkerState.STOPPED for w in workers)
    click.echo(f"{host}: {', '.join(states) if states else 'no worker registered'}")
    sys.exit(0 if healthy else 1)


def all_ranks_ready(worker: WorkerInfo) -> bool:
    """Every rank of a tensor-parallel worker is up (a one-device worker has no such entry)."""
    tp = worker.stats.get("tensor_parallel")
    return not isinstance(tp, dict) or tp.get("ranks_ready") == tp.get("size")


def register(group: click.Group) -> None:
    """Add ``probe`` to the ``cloverq`` group."""
    group.add_command(probe_group)


if __name__ == "__main__":  # `python -m cli.probe worker --ready`: skips loading every CLI module
    probe_group(prog_name="cloverq probe")
