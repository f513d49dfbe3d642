"""Child-process supervision for ``cloverq up``: start, watch, and stop with no orphans.

Each child runs in its own session (process group), so stopping it signals the whole group
(anything it forked goes too). On Linux each child also gets ``PR_SET_PDEATHSIG`` = SIGTERM,
so even if ``cloverq up`` itself is killed with SIGKILL its children are told to stop.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    """One supervised process."""

    name: str
    process: subprocess.Popen[bytes]
    stop_timeout: float
    argv: tuple[str, ...] = ()  # how it was started, so it can be started again
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class RestartBudget:
    """At most ``max_restarts`` restarts within ``window_seconds``: a process that dies now and
    then (a broker restart, an OOM) is restarted, one that cannot stay up fails loudly."""

    max_restarts: int = 5
    window_seconds: float = 60.0
    _times: deque[float] = field(default_factory=deque)

    def allow(self, now: float) -> bool:
        """Whether one more restart at ``now`` (monotonic seconds) fits; counts it if so."""
        while self._times and now - self._times[0] > self.window_seconds:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True


@dataclass
class Supervisor:
    """Starts children and stops them in reverse start order."""

    log_dir: Path
    children: list[Child] = field(default_factory=list)

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stop_timeout: float = 30.0,
        inherit_output: bool = False,
        pass_fds: Sequence[int] = (),
    ) -> Child:
        """Start ``argv`` in its own process group; output goes to ``log_dir/<name>.log``.

        ``pass_fds``: open descriptors the child inherits (the API's listening socket).
        """
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        stdout = None if inherit_output else open(log_path, "ab")  # noqa: SIM115 (closed below)
        process = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout is not None else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            pass_fds=tuple(pass_fds),
        )
        if stdout is not None:
            stdout.close()
        child = Child(name=name, process=process, stop_timeout=stop_timeout, argv=tuple(argv),
                      env=dict(env))
        self.children.append(child)
        return child

    def restart(self, child: Child) -> Child:
        """Start a dead ``child`` again with its command and environment, in its place in the
        stop order (a child that was handed descriptors, the API, cannot be restarted)."""
        index = self.children.index(child)
        self.children.remove(child)
        fresh = self.start(child.name, child.argv, env=child.env, stop_timeout=child.stop_timeout)
        self.children.remove(fresh)
        self.children.insert(index, fresh)
        return fresh

    def first_dead(self) -> Child | None:
        """A child that exited on its own, if any."""
        return next((child for child in self.children if not child.alive), None)

    def stop_all(self) -> None:
        """Newest first, one at a time: SIGTERM the group, wait, SIGKILL if it lingers.

        One at a time so that what started first (Redis) outlives what depends on it (the
        worker draining its running jobs).
        """
        for child in reversed(self.children):
            _signal_group(child.process, signal.SIGTERM)
            deadline = time.monotonic() + child.stop_timeout
            while child.alive and time.monotonic() < deadline:
                time.sleep(0.05)
            _signal_group(child.process, signal.SIGKILL)  # the group may hold stragglers
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=5)
        self.children.clear()


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)
