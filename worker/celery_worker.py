"""The GPU worker process: ``python -m worker.celery_worker`` (what ``cloverq worker`` runs).

A Celery worker with a threads pool sized to the engine batch (no fork: CUDA stays in this
process). Model load + warm-up happen in ``worker_init``, before the consumer starts, so no
job is taken before the model is resident; the registry says ``ready`` on ``worker_ready``.
SIGTERM is Celery's warm shutdown: consuming stops at once (registry ``draining``), running
tasks finish, then the engine stops and the worker leaves the registry.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from celery import signals

from scheduler.infra.celery_app import get_celery_app
from scheduler.infra.process import run_then_exit
from scheduler.infra.schema_check import exit_on_schema_behind
from scheduler.infra.settings import Settings, get_settings
from scheduler.infra.tls_check import exit_on_tls_failure
from scheduler.observability.logging import configure_logging
from scheduler.observability.tracing import setup_tracing
from worker import control_commands, tasks
from worker.class_gates import interactive_reserve
from worker.runtime import WorkerRuntime, get_runtime, set_runtime

# Imported for what importing them does: cloverq.run_job (a shared task, on every app) and the
# drain-sync remote-control command (Celery's process-global Panel), before any worker starts.
_REGISTERED = (tasks, control_commands)


def worker_argv(settings: Settings, *, queues: Sequence[str], concurrency: int, hostname: str) -> list[str]:
    """Arguments of ``celery worker`` for the GPU worker."""
    return [
        "worker", "--pool=threads", f"--concurrency={concurrency}", f"--queues={','.join(queues)}",
        f"--hostname={hostname}", "--without-gossip", "--without-mingle", "--without-heartbeat",
        f"--loglevel={settings.observability.log_level}",
    ]


def _connect_signals(runtime: WorkerRuntime) -> None:
    # weak=False: the receivers are closures and must outlive this function.
    def on_init(sender: Any = None, **_: Any) -> None:
        runtime.start()
        if sender is not None:  # before the consumer exists: no drained queue, a canary's lanes
            runtime.select_queues_at_start(sender.app.amqp.queues)

    def on_ready(sender: Any = None, **_: Any) -> None:
        runtime.mark_ready(sender)  # the Consumer: queues are switched on it, in process

    def on_shutting_down(**_: Any) -> None:
        runtime.mark_draining()

    def on_shutdown(**_: Any) -> None:
        runtime.stop()

    signals.worker_init.connect(on_init, weak=False)
    signals.worker_ready.connect(on_ready, weak=False)
    signals.worker_shutting_down.connect(on_shutting_down, weak=False)
    signals.worker_shutdown.connect(on_shutdown, weak=False)


def _option(args: Sequence[str], *names: str) -> str | None:
    """The value of a Celery CLI option in ``args`` (``-Q x``, ``--queues=x``), last one wins."""
    value = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                value = args[i + 1]
            elif name.startswith("--") and arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def _without_options(args: Sequence[str], *names: str) -> list[str]:
    """``args`` minus the named options and their values (we pass those ourselves)."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not any(arg.startswith(n + "=") for n in names if n.startswith("--")):
            out.append(arg)
    return out


def _keep_our_logging(**_: Any) -> None:
    """Celery's ``setup_logging`` receiver: its presence stops Celery from reconfiguring logging."""


def run_worker(
    settings: Settings | None = None,
    extra_args: Sequence[str] = (),
    *,
    queues: Sequence[str] | None = None,
    concurrency: int | None = None,
    hostname: str | None = None,
) -> None:
    """Run the worker in the foreground until SIGTERM/SIGINT.

    ``extra_args`` go to ``celery worker`` after ours; ``-Q/--queues``, ``-c/--concurrency`` and
    ``-n/--hostname`` among them are honoured (and published in the worker registry).
    """
    settings = settings or get_settings()
    exit_on_tls_failure(settings)  # a wrong CA or an expired certificate: one line, exit 78
    exit_on_schema_behind(settings)  # a database that missed `cloverq migrate`: one line, exit 78
    queues_opt = _option(extra_args, "-Q", "--queues")
    concurrency_opt = _option(extra_args, "-c", "--concurrency")
    hostname = hostname or _option(extra_args, "-n", "--hostname")
    if queues is None and queues_opt:
        queues = queues_opt.split(",")
    queue_list = tuple(q.strip() for q in (queues or settings.worker.queues.split(",")) if q.strip())
    node = hostname or f"cloverq-{os.getpid()}@{socket.gethostname()}"
    batch = settings.engine.max_batch + interactive_reserve(queue_list, settings.engine.interactive_reserve)
    threads = concurrency or (int(concurrency_opt) if concurrency_opt else batch)
    passthrough = _without_options(extra_args, "-Q", "--queues", "-c", "--concurrency", "-n", "--hostname")
    app = get_celery_app()
    app.set_current()
    app.set_default()
    configure_logging(settings)  # JSON lines; Celery keeps its hands off (setup_logging receiver)
    signals.setup_logging.connect(_keep_our_logging, weak=False)
    setup_tracing(settings, process="worker", drops_to_redis=True)  # off by default: creates nothing
    apply_switch_interval(settings)
    runtime = WorkerRuntime(settings, worker_id=node, queues=queue_list)
    set_runtime(runtime)
    _connect_signals(runtime)
    argv = worker_argv(settings, queues=queue_list, concurrency=threads, hostname=node)
    run_then_exit(lambda: app.worker_main([*argv, *passthrough]))


def apply_switch_interval(settings: Settings) -> None:
    """Shorten Python's thread switch interval in this process (``worker_switch_interval_ms``).

    The engine thread runs Python between its torch calls and keeps the GIL until another thread
    asks for it AND the interval has passed. Claiming a job takes many hand-overs (the Celery
    consumer, the task thread, the database driver), each one a wait of up to the interval, so
    Python's 5 ms made an interactive job wait hundreds of milliseconds for its claim under bulk
    load although a reserved thread was free (docs/architecture.md §3.4)."""
    sys.setswitchinterval(settings.worker.switch_interval_ms / 1000.0)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m worker.celery_worker", description=__doc__)
    parser.add_argument("--queues", help="comma-separated queues in priority order (default: settings)")
    parser.add_argument("--concurrency", type=int, help="task threads (default: engine_max_batch)")
    parser.add_argument("--hostname", help="Celery node name / worker id")
    args = parser.parse_args(argv)
    queues = [q.strip() for q in args.queues.split(",")] if args.queues else None
    run_worker(queues=queues, concurrency=args.concurrency, hostname=args.hostname)


__all__ = ["get_runtime", "main", "run_worker", "worker_argv"]

if __name__ == "__main__":
    main()
    sys.exit(0)
