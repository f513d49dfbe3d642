"""A throwaway Redis Sentinel set on loopback: one master, one replica, three sentinels.

The set is ``bench/fleet_services.py``'s :class:`SentinelSet` (real ``redis-server`` processes,
sentinel mode built into the server binary, each with its config in a temp dir, on free ports;
``down-after-milliseconds`` 1000 and ``failover-timeout`` 3000, so that a failover takes seconds,
not the default minutes). :func:`sentinel_missing` says why a set cannot start here.
"""

from __future__ import annotations

import subprocess

from bench.fleet_services import NO_REDIS_SERVER, SentinelSet, redis_server_binary

__all__ = ["SentinelSet", "sentinel_missing"]


def sentinel_missing() -> str | None:
    """Why no Sentinel set can run here (no binary, or one without sentinel mode), or None."""
    binary = redis_server_binary()
    if binary is None:
        return NO_REDIS_SERVER
    try:  # without a config file, a server with sentinel mode says so and exits at once
        done = subprocess.run([binary, "--sentinel"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{binary} does not run: {exc}"
    said = (done.stdout + done.stderr).strip()
    if "Sentinel needs config file" in said:
        return None
    return f"{binary} has no sentinel mode (redis-server --sentinel said: {said[:200]!r})"
