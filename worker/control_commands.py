"""cloverq's own Celery remote-control commands, handled on the worker's consumer thread.

One command: ``scheduler.drain.SYNC_DRAINS_COMMAND``, sent by the admin API after it changed a
drain flag, makes the worker read the flags now (``worker/queue_drain.py`` ``DrainFollower``)
instead of at its next heartbeat. It carries no queue names and changes no consumer itself: the
consumer controller (``worker/consumers.py``) decides and switches in process, so what a worker
consumes has one mechanism and no broadcast can run out of order with it (issue 31).

Registered on import (Celery's ``Panel`` is process-global); ``worker/celery_worker.py`` imports it
before the worker starts.
"""

from __future__ import annotations

from typing import Any

from celery.worker.control import control_command

from scheduler.fleet.queue_drain import SYNC_DRAINS_COMMAND
from worker.runtime import get_runtime


@control_command(name=SYNC_DRAINS_COMMAND)
def sync_drains(state: Any, **_: Any) -> dict[str, str]:
    """Read the drain flags now and let the consumer controller follow them."""
    get_runtime().drain_follower.sync()
    return {"ok": "drain flags read"}
