"""The beat schedule (the one module that owns it) and the light beat process.

``cloverq beat`` runs a small Celery worker that consumes only the ``maintenance`` queue with
an embedded beat scheduler (``-B``): it never touches the GPU and never loads a model. Run
exactly one. Tasks: reconciler (+ aging), reaper, expiry — see ``scheduler/maintenance.py`` —
and webhook deliveries (``webhooks`` queue) + their sweeper (``scheduler/webhook_tasks.py``).
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

from scheduler.process import run_then_exit
from scheduler.queue_names import MAINTENANCE_QUEUE, WEBHOOKS_QUEUE
from scheduler.settings import Settings, get_settings


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """Celery ``beat_schedule``; every entry expires before its next run so a backlog never piles up."""

    def entry(task: str, every: float) -> dict[str, Any]:
        return {"task": task, "schedule": every,
                "options": {"queue": MAINTENANCE_QUEUE, "expires": max(1.0, every)}}

    return {
        "reconcile": entry("cloverq.reconcile", settings.beat.reconcile_interval_seconds),
        "reap": entry("cloverq.reap", settings.beat.reaper_interval_seconds),
        "expire": entry("cloverq.expire", settings.beat.expiry_interval_seconds),
        "sweep-webhooks": entry("cloverq.sweep_webhooks", settings.webhooks.sweep_interval_seconds),
    }


def beat_argv(settings: Settings) -> list[str]:
    """Arguments of the beat process's Celery worker (schedule state under ``data_dir``)."""
    schedule_file = Path(settings.data_dir) / "celerybeat-schedule"
    schedule_file.parent.mkdir(parents=True, exist_ok=True)
    return [
        # threads: a slow webhook endpoint must not hold up maintenance ticks (or other hooks).
        "worker", "--beat", f"--schedule={schedule_file}", "--pool=threads",
        f"--concurrency={settings.beat.threads}",
        f"--queues={MAINTENANCE_QUEUE},{WEBHOOKS_QUEUE}", f"--hostname=beat@{socket.gethostname()}",
        "--without-gossip", "--without-mingle", f"--loglevel={settings.observability.log_level}",
    ]


def run_beat(settings: Settings | None = None) -> None:
    """Run the beat process in the foreground until SIGTERM/SIGINT (used by ``cloverq beat``)."""
    from scheduler.celery_app import get_celery_app
    from scheduler.logging import configure_celery_logging

    settings = settings or get_settings()
    configure_celery_logging(settings)  # JSON lines like every other process
    app = get_celery_app()
    app.set_current()
    run_then_exit(lambda: app.worker_main(beat_argv(settings)))


if __name__ == "__main__":
    run_beat()
    sys.exit(0)
