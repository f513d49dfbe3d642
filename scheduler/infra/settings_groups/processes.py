"""The worker and beat processes (``settings.worker``, ``settings.beat``)."""

from __future__ import annotations

from pydantic import Field

from scheduler.infra.queue_names import DEFAULT_WORKER_QUEUES
from scheduler.infra.settings_groups.base import SettingsGroup


class WorkerSettings(SettingsGroup):
    """The worker process: the queues it consumes, its heartbeat, its threads; test-only faults."""

    heartbeat_seconds: float = Field(
        2.0, gt=0, alias="worker_heartbeat_seconds", description="Worker registry heartbeat."
    )
    switch_interval_ms: float = Field(
        0.5, gt=0, le=100, alias="worker_switch_interval_ms",
        description="Worker: Python's thread switch interval (sys.setswitchinterval). The engine thread "
        "holds the GIL between torch calls; at Python's 5 ms a task thread claiming an interactive job "
        "waits up to that long at every hand-over (bench.mix under bulk load, back to back on a loaded host: "
        "p95 wait 508 ms at 5, 15 ms at 0.5).",
    )
    queues: str = Field(
        ",".join(DEFAULT_WORKER_QUEUES), alias="worker_queues",
        description="Queues a worker consumes, in order.",
    )
    fault_injection: bool = Field(False, description="TESTS ONLY: honour params.fault in the worker.")
    fault_stall_seconds: float = Field(30.0, ge=0, description="TESTS ONLY: how long a 'stall' fault waits.")


class BeatSettings(SettingsGroup):
    """The beat process: its maintenance tasks and their intervals (webhooks has its own sweep)."""

    reconcile_interval_seconds: float = Field(5.0, gt=0, description="Beat: re-enqueue lost messages.")
    reconcile_grace_seconds: float = Field(2.0, ge=0, description="Age before a queued row counts as lost.")
    reaper_interval_seconds: float = Field(10.0, gt=0, description="Beat: requeue expired leases.")
    expiry_interval_seconds: float = Field(300.0, gt=0, description="Beat: expire old results.")
    expiry_batch: int = Field(
        1000, ge=1, description="Jobs one expiry statement expires at most; a tick repeats it, each batch "
        "its own short transaction under the statement timeout, until none is due.",
    )
    delayed_interval_seconds: float = Field(
        1.0, gt=0, description="Beat: publish delayed jobs that came due (an index range scan per tick).",
    )
    purge_interval_seconds: float = Field(
        10.0, gt=0, description="Beat: purge the data of jobs whose retention passed (or that expired).",
    )
    purge_batch: int = Field(500, ge=1, description="Jobs one purge tick schedules and purges at most.")
    lease_seconds: float = Field(
        10.0, gt=0, alias="beat_lease_seconds",
        description="Beat leader lease (Redis): any number of beat processes run, the holder dispatches the "
        "periodic tasks and renews every third of it; a dead or hung leader is replaced within 4/3 of it.",
    )
    threads: int = Field(
        4, ge=1, alias="light_worker_threads",
        description="Threads of the beat process (maintenance tasks + webhook deliveries).",
    )
