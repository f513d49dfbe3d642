"""The light beat process (its schedule: ``scheduler/infra/beat_schedule.py``).

``cloverq beat`` runs a small Celery worker that consumes only the ``maintenance`` queue with
an embedded beat scheduler (``-B``): it never touches the GPU and never loads a model. Tasks:
reconciler (+ aging), reaper, expiry, data purge (retention) — see
``scheduler/maintenance/tasks.py`` —, the delayed-job tick (``scheduler/maintenance/delayed.py``)
and webhook deliveries (``webhooks`` queue) + their sweeper (``scheduler/webhooks/tasks.py``).

Run one or more: the embedded scheduler is ``scheduler/maintenance/beat_scheduler.py``
``LeaderScheduler``, so only the holder of the leader lease dispatches the periodic tasks and
the others stand by to take over (``scheduler/maintenance/beat_leader.py``); every beat process
consumes the two queues either way.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from celery.signals import beat_embedded_init

from scheduler.infra.celery_app import get_celery_app
from scheduler.infra.process import run_then_exit
from scheduler.infra.queue_names import MAINTENANCE_QUEUE, WEBHOOKS_QUEUE
from scheduler.infra.schema_check import exit_on_schema_behind
from scheduler.infra.settings import Settings, get_settings
from scheduler.infra.tls_check import exit_on_tls_failure
from scheduler.maintenance.beat_scheduler import exit_on_sigterm
from scheduler.observability.logging import configure_celery_logging
from scheduler.observability.tracing import setup_tracing

# Celery's embedded beat with the leader check (imported by name in the beat process only).
SCHEDULER = "scheduler.maintenance.beat_scheduler:LeaderScheduler"


def beat_argv(settings: Settings) -> list[str]:
    """Arguments of the beat process's Celery worker (schedule state under ``data_dir``)."""
    schedule_file = Path(settings.data_dir) / "celerybeat-schedule"
    schedule_file.parent.mkdir(parents=True, exist_ok=True)
    return [
        # threads: a slow webhook endpoint must not hold up maintenance ticks (or other hooks).
        "worker", "--beat", f"--schedule={schedule_file}", f"--scheduler={SCHEDULER}", "--pool=threads",
        f"--concurrency={settings.beat.threads}",
        f"--queues={MAINTENANCE_QUEUE},{WEBHOOKS_QUEUE}", f"--hostname=beat@{socket.gethostname()}",
        "--without-gossip", "--without-mingle", f"--loglevel={settings.observability.log_level}",
    ]


def run_beat(settings: Settings | None = None) -> None:
    """Run the beat process in the foreground until SIGTERM/SIGINT (used by ``cloverq beat``)."""
    settings = settings or get_settings()
    exit_on_tls_failure(settings)  # a wrong CA or an expired certificate: one line, exit 78
    exit_on_schema_behind(settings)  # a database that missed `cloverq migrate`: one line, exit 78
    configure_celery_logging(settings)  # JSON lines like every other process
    # republishes and webhook deliveries join their job's trace
    setup_tracing(settings, process="beat", drops_to_redis=True)
    app = get_celery_app()
    app.set_current()
    beat_embedded_init.connect(exit_on_sigterm, weak=False)  # the lease is released on a clean stop
    run_then_exit(lambda: app.worker_main(beat_argv(settings)))


if __name__ == "__main__":
    run_beat()
    sys.exit(0)
