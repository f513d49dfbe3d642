"""The beat schedule: the one module that owns which periodic task runs how often.

Below the Celery app (``celery_app`` sets it as ``beat_schedule``) and apart from the beat process
(``scheduler/maintenance/beat.py``), which imports the app: the schedule is configuration of the
app, the process is one of its users. Task names only (``cloverq.*``): no task module is imported.
"""

from __future__ import annotations

from typing import Any

from scheduler.infra.queue_names import MAINTENANCE_QUEUE
from scheduler.infra.settings import Settings


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """Celery ``beat_schedule``; every entry expires before its next run so a backlog never piles up."""

    def entry(task: str, every: float) -> dict[str, Any]:
        return {"task": task, "schedule": every,
                "options": {"queue": MAINTENANCE_QUEUE, "expires": max(1.0, every)}}

    return {
        "reconcile": entry("cloverq.reconcile", settings.beat.reconcile_interval_seconds),
        "release-delayed": entry("cloverq.release_delayed", settings.beat.delayed_interval_seconds),
        "release-fair": entry("cloverq.release_fair", settings.scheduling.fair_share_tick_seconds),
        "reap": entry("cloverq.reap", settings.beat.reaper_interval_seconds),
        "expire": entry("cloverq.expire", settings.beat.expiry_interval_seconds),
        "purge-data": entry("cloverq.purge_data", settings.beat.purge_interval_seconds),
        "sweep-webhooks": entry("cloverq.sweep_webhooks", settings.webhooks.sweep_interval_seconds),
    }
