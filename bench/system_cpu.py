"""CPU seconds per process of the stack, from ``/proc`` (``bench/system.py``'s breakdown).

On a small CPU machine every CPU-second the API, beat, Redis, the database, the bench client and
the worker's own non-engine threads use is taken from the engine (torch runs on every core), so
``bench.system`` reports who used how much during the saturated phase and the bound that
follows: ``engine tokens/s x (1 - their share of the machine)``.

Linux only (``/proc``); elsewhere every reading is 0 and the breakdown says nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

try:
    TICK = float(os.sysconf("SC_CLK_TCK"))
except (AttributeError, ValueError, OSError):  # not POSIX
    TICK = 100.0


def _stat_fields(path: str) -> list[str] | None:
    """The fields of a ``/proc/.../stat`` line after ``comm`` (which may hold spaces and ``)``)."""
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            line = handle.read()
    except OSError:
        return None
    return line[line.rfind(")") + 2:].split()


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (or of its thread ``tid``); 0.0 once gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = _stat_fields(path)
    if fields is None or len(fields) < 13:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14 and 15 of stat)


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it (a beat's scheduler child, uvicorn's workers)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return [pid]
    for entry in entries:
        if not entry.isdigit():
            continue
        fields = _stat_fields(f"/proc/{entry}/stat")
        if fields is not None and len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def thread_seconds(pid: int) -> dict[int, float]:
    """CPU seconds of each live thread of ``pid`` by thread id."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return {}
    return {tid: cpu_seconds(pid, tid) for tid in tids}


def machine_busy() -> float:
    """CPU seconds every process of the machine has used since boot (all cores; ``/proc/stat``):
    less this run's own, what the rest of the machine took from it."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            fields = handle.readline().split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / TICK


@dataclass
class Snapshot:
    """CPU seconds per named group of processes (each with its descendants) at one moment, and
    per thread of the processes whose threads are watched."""

    groups: dict[str, float]
    threads: dict[str, dict[int, float]] = field(default_factory=dict)


def snapshot(groups: Mapping[str, Iterable[int]], *, watch_threads: Iterable[str] = (),
             alone: Iterable[str] = ()) -> Snapshot:
    """CPU seconds used so far by each group (a group: root pids, their descendants counted but
    for the groups named in ``alone``: the bench's own process, whose children are the stack)."""
    watched, by_itself = set(watch_threads), set(alone)
    totals: dict[str, float] = {}
    threads: dict[str, dict[int, float]] = {}
    for name, pids in groups.items():
        roots = list(pids)
        members = roots if name in by_itself else [p for root in roots for p in descendants(root)]
        totals[name] = sum(cpu_seconds(p) for p in members)
        if name in watched and roots:
            threads[name] = thread_seconds(roots[0])
    return Snapshot(totals, threads)


@dataclass
class Usage:
    """CPU seconds each group used between two snapshots; for watched processes, the seconds of
    their ``top`` busiest threads (the engine thread and torch's intra-op pool) apart."""

    seconds: dict[str, float]
    top_threads: dict[str, float] = field(default_factory=dict)
    busiest: dict[str, list[float]] = field(default_factory=dict)  # each thread's seconds, most first

    def total(self, names: Iterable[str] | None = None) -> float:
        return sum(v for k, v in self.seconds.items() if names is None or k in set(names))


def usage(before: Snapshot, after: Snapshot, *, top: int = 1) -> Usage:
    """What each group used from ``before`` to ``after`` (a process that exited in between
    counts what it had used up to ``before`` as 0: its last seconds are lost)."""
    seconds = {name: max(0.0, after.groups.get(name, 0.0) - before.groups.get(name, 0.0))
               for name in after.groups}
    top_threads, busiest = {}, {}
    for name, now in after.threads.items():
        then = before.threads.get(name, {})
        deltas = sorted((max(0.0, s - then.get(tid, 0.0)) for tid, s in now.items()), reverse=True)
        top_threads[name] = sum(deltas[:top])
        busiest[name] = deltas
    return Usage(seconds, top_threads, busiest)


def bound(engine_tokens_per_second: float, other_cpu_seconds: float, wall_seconds: float,
          cores: int) -> tuple[float, float]:
    """``(share, tokens/s)``: the share of the machine (``cores x wall``) that ``other_cpu_seconds``
    took, and the engine's tokens/s scaled by what that leaves for it."""
    if wall_seconds <= 0 or cores <= 0:
        return 0.0, engine_tokens_per_second
    share = min(1.0, other_cpu_seconds / (cores * wall_seconds))
    return share, engine_tokens_per_second * (1.0 - share)
