"""A whole fleet under load while each of its processes is restarted in turn (``python -m bench.fleet``).

Issue 32. Everything is started and stopped here, on loopback only (``bench/fleet_services.py``):
3 ``cloverq api`` replicas behind HAProxy (``deploy/haproxy/haproxy.cfg``), 2 workers on the tiny
demo checkpoint, 2 beats (a leader and a standby, each with its own schedule file), Redis master +
replica + 3 sentinels (every process on ``redis+sentinel://``) and a PostgreSQL cluster of its own.
``--clients`` (64) clients submit jobs through HAProxy (each submit with an ``Idempotency-Key``,
repeated after a 503 / 429 / transport error) and long-poll each to its end, for ``--seconds``
(300). After a quiet baseline slot, one restart per slot, in the documented rolling order's spirit:
each API replica (SIGTERM: drain, then a new process on the same port, until HAProxy sees it UP),
each worker (SIGTERM: its jobs finish; a new one until ready), the beat leader (SIGTERM: the
standby leads; the takeover time is printed; a new standby is started), a Redis failover
(``SENTINEL FAILOVER``) and a PostgreSQL restart (``pg_ctl stop -m fast``, start).

At the end it checks and prints:

- **exactly once**: every accepted job is in SQL, final, with exactly one outcome write (a
  trigger records every ``running`` -> final update, as the chaos tests do), a stored result when
  it succeeded, ``1 <= attempt <= max_attempts``; jobs in SQL that no client learned of;
- **periodic work**, counted from the beats' own records: Celery beat's ``Sending due task NAME``
  lines (the beats log at INFO) per task and process, against the expected count (the time a beat
  led / the interval). Two dispatches of one task by one process closer than half its interval
  are duplicates; consecutive dispatches by different processes are hand-overs, which may happen
  only at a leadership change (``beat.leader_acquired`` lines): more hand-overs than changes would
  be two leaders at once. Each dispatched task's executions (``Task NAME[id] succeeded`` / ``raised``
  lines of the beat that consumed it) are counted too: an id run twice is a duplicate execution (a
  message handed back by a stopping beat and received again elsewhere is a redelivery, counted
  apart; a dropped tick, ``Task NAME[id] ignored``, is counted as dropped, not as a run, with its
  reason from ``scheduler/infra/periodic_tick.py``'s events: its id claimed before, a superseded
  beat leadership, or a check that could not reach the database or Redis);
- **errors by kind**: every answer that was not a 2xx, by request kind and status (a 503 with or
  without ``Retry-After``), and transport errors by exception; a 5xx other than a 503 with
  ``Retry-After`` fails the run;
- **p99 submit latency** (one POST through HAProxy until its answer, accepted answers only) during
  each restart window (from the restart's start until its process is ready again, plus 3 s)
  against the quiet baseline slot of the same run.

``--beats-only``: two beats (and their Redis and PostgreSQL, no API, no worker, default intervals)
for ``--seconds``; every periodic task's dispatch count against ``seconds / interval``; then the
leader is SIGKILLed and the standby must lead within the bound (lease x 4/3); prints the counts and
the takeover time.

The machine's CPU is shared by every process here: read the latencies with that in mind.
``--json FILE`` writes the report.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text

from bench.fleet_services import (
    HAPROXY_SERVERS,
    Haproxy,
    Postgres,
    SentinelSet,
    Service,
    free_port,
    postgres_bin_dir,
    stop_all,
    wait_until,
)
from scheduler.infra.settings import available_cpus

FINAL = ("succeeded", "failed", "cancelled")
JOB_PARAMS: dict[str, Any] = {"max_new_tokens": 4, "steps_per_block": 1}  # one block, one pass
SETTLE_SECONDS = 3.0  # a restart window lasts until its process is ready again, plus this
EVENTS = ("api1", "api2", "api3", "worker1", "worker2", "beat-leader", "redis-failover", "postgres")
# Fleet settings: short intervals so a 5-minute run counts many periods, and fast recoveries.
FLEET_SETTINGS: dict[str, Any] = {
    "auth": "disabled",
    "rate_limit_per_second": 0,
    "tenant_max_active_jobs": 1_000_000,
    "api_drain_seconds": 2.0,  # HAProxy (inter 200 ms, fall 2) takes a draining replica out within it
    "lease_seconds": 5.0,
    "reconcile_interval_seconds": 1.0,
    "reconcile_grace_seconds": 1.0,
    "reaper_interval_seconds": 1.0,
    "expiry_interval_seconds": 10.0,
    "beat_lease_seconds": 3.0,
    "worker_heartbeat_seconds": 0.5,
    "engine_max_batch": 8,
    "torch_threads": 1,
    "log_level": "WARNING",
}
BEATS_ONLY_SETTINGS: dict[str, Any] = {"auth": "disabled", "log_level": "WARNING"}  # default intervals

_AUDIT = [
    "CREATE TABLE IF NOT EXISTS fleet_outcome_writes (job_id uuid, attempt int, status text, "
    "at timestamptz default now())",
    """CREATE OR REPLACE FUNCTION fleet_record_outcome() RETURNS trigger AS $$
       BEGIN INSERT INTO fleet_outcome_writes(job_id, attempt, status)
             VALUES (NEW.id, NEW.attempt, NEW.status); RETURN NEW; END $$ LANGUAGE plpgsql""",
    """CREATE TRIGGER fleet_outcome AFTER UPDATE OF status ON jobs FOR EACH ROW
       WHEN (OLD.status = 'running' AND NEW.status IN ('succeeded', 'failed', 'cancelled'))
       EXECUTE FUNCTION fleet_record_outcome()""",
]


@dataclass
class FleetOptions:
    seconds: float = 300.0
    clients: int = 64
    apis: int = 3
    workers: int = 2
    beats: int = 2
    events: tuple[str, ...] = EVENTS
    beats_only: bool = False
    warmup_seconds: float = 5.0
    # Wait for each restarted process to be ready before the next restart (a rolling restart). The
    # chaos test's short run does not: the next restart follows at once and every process is waited
    # for before the PostgreSQL restart and at the end (the others serve meanwhile), which saves a
    # start-up per restart.
    wait_ready: bool = True
    workdir: Path | None = None
    keep: bool = False  # keep the work dir (logs) afterwards
    quiet: bool = False  # no progress lines


# --- the fleet ----------------------------------------------------------------------------------------


@dataclass
class Role:
    """One process of the fleet by role (``api1``, ``worker2``, ``beat1`` ...), across restarts."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int | None = None
    generation: int = 0
    service: Service | None = None
    past: list[Service] = field(default_factory=list)

    def start(self, log_dir: Path) -> Service:
        if self.service is not None:
            self.past.append(self.service)
        self.generation += 1
        self.service = Service(f"{self.name}.{self.generation}", self.argv, self.env,
                               log_dir / f"{self.name}.{self.generation}.log").start()
        return self.service

    def services(self) -> list[Service]:
        return [*self.past, *([self.service] if self.service else [])]


class Fleet:
    """The processes and services of one run, in ``root``."""

    def __init__(self, root: Path, options: FleetOptions, say: Callable[[str], None]) -> None:
        self.root = root
        self.options = options
        self.say = say
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.redis = SentinelSet(root / "redis")
        bin_dir = postgres_bin_dir()
        if bin_dir is None:
            raise SystemExit("no PostgreSQL server binaries (apt-get install -y postgresql)")
        self.postgres = Postgres(bin_dir, root / "pg")
        self.apis: list[Role] = []
        self.workers: list[Role] = []
        self.beats: list[Role] = []
        self.haproxy: Haproxy | None = None
        self.engine: Any = None
        self.settings: Any = None

    # --- start / stop ---------------------------------------------------------------------------
    def start(self) -> None:
        from scheduler.infra.db import migrate
        from scheduler.infra.settings import Settings

        began = time.monotonic()
        self.redis.start()
        self.postgres.init()
        self.postgres.start()
        migrate(self.postgres.url)
        self.engine = create_engine(self.postgres.url, pool_pre_ping=True)
        with self.engine.begin() as conn:
            for statement in _AUDIT:
                conn.execute(text(statement))
        values = BEATS_ONLY_SETTINGS if self.options.beats_only else FLEET_SETTINGS
        checkpoint = None
        if not self.options.beats_only:
            from worker.model.demo import write_demo_checkpoint

            checkpoint = write_demo_checkpoint(self.root / "model" / "tiny", seed=0, size="tiny",
                                               arch="clover")

        def env(data_dir: Path, **extra: Any) -> dict[str, str]:
            settings = Settings(database_url=self.postgres.url, redis_url=self.redis.url, data_dir=data_dir,
                                model_dir=checkpoint, **{**values, **extra})
            self.settings = self.settings or settings
            return {**os.environ, **settings.to_env(), "PYTHONUNBUFFERED": "1"}

        python = sys.executable
        for index in range(1, self.options.workers + 1):
            self.workers.append(Role(f"worker{index}", [python, "-m", "cli", "worker"],
                                     env(self.root / f"data-worker{index}")))
        for index in range(1, self.options.beats + 1):  # INFO: Celery beat logs every dispatch
            self.beats.append(Role(f"beat{index}", [python, "-m", "cli", "beat"],
                                   env(self.root / f"data-beat{index}", log_level="INFO")))
        for index in range(1, self.options.apis + 1):
            port = free_port()
            self.apis.append(Role(f"api{index}", [python, "-m", "cli", "api", "--host", "127.0.0.1", "--port",
                                                  str(port)], env(self.root / f"data-api{index}"), port=port))
        for role in [*self.workers, *self.beats, *self.apis]:  # start-ups overlap
            role.start(self.logs)
        if self.apis:
            self.haproxy = Haproxy([role.port or 0 for role in self.apis], self.logs / "haproxy.log")
            self.haproxy.start()
        self.wait_all_ready(beat_leading=True)
        self.redis.wait_quorum()
        self.say(f"fleet up in {time.monotonic() - began:.1f} s (logs in {self.logs})")

    def stop(self) -> None:
        roles = [*self.apis, *self.workers, *self.beats]
        stop_all([role.service for role in roles if role.service is not None], timeout=30)
        if self.haproxy is not None:
            self.haproxy.stop()
        if self.engine is not None:
            self.engine.dispose()
        try:
            self.postgres.stop("immediate")
        except Exception as exc:
            print(f"PostgreSQL did not stop cleanly: {exc}", file=sys.stderr)
        self.redis.stop()

    # --- readiness ------------------------------------------------------------------------------
    def redis_client(self) -> Any:
        from scheduler.infra.redis_client import redis_from_url

        return redis_from_url(self.redis.url, decode_responses=True, socket_timeout=5,
                              socket_connect_timeout=2)

    def wait_worker(self, role: Role, timeout: float = 180.0) -> None:
        from scheduler.fleet.workers import list_workers

        service = role.service
        assert service is not None
        client = self.redis_client()

        def ready() -> bool:
            if not service.alive():
                raise RuntimeError(f"{role.name} exited:\n{service.log()[-3000:]}")
            try:
                return any(info.pid == service.pid and info.is_ready for info in list_workers(client))
            except Exception:
                return False

        wait_until(ready, timeout=timeout, interval=0.2, what=f"{role.name} ready")

    def wait_api(self, role: Role, timeout: float = 120.0) -> None:
        service = role.service
        assert service is not None

        def up() -> bool:
            if not service.alive():
                raise RuntimeError(f"{role.name} exited:\n{service.log()[-3000:]}")
            try:
                answer = httpx.get(f"http://127.0.0.1:{role.port}/readyz/replica", timeout=1.0)
                return answer.status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=timeout, interval=0.1, what=f"{role.name} ready")

    def leader(self) -> str | None:
        from scheduler.infra.leader_lease import parse_value
        from scheduler.infra.redis_keys import BEAT_LEADER_KEY

        try:
            lease = parse_value(self.redis_client().get(BEAT_LEADER_KEY))
        except Exception:
            return None
        return lease.name if lease is not None else None

    def beat_members(self) -> set[str]:
        from scheduler.infra.redis_keys import BEAT_MEMBERS_SET, beat_member

        client = self.redis_client()
        return {name for name in client.smembers(BEAT_MEMBERS_SET) if client.exists(beat_member(name))}

    def leader_role(self) -> Role:
        """The beat role whose process group holds the embedded beat process named in the lease."""
        name = wait_until(self.leader, timeout=30, interval=0.1, what="a beat leader")
        group = os.getpgid(int(name.rsplit(":", 1)[1]))
        return next(role for role in self.beats if role.service is not None and role.service.pid == group)

    # --- restarts -------------------------------------------------------------------------------
    def restart(self, event: str, *, wait_ready: bool = True) -> dict[str, Any]:
        """Carry out one restart; returns what was measured (``ready_at``: monotonic). Without
        ``wait_ready`` it returns once the new process is started (see :meth:`wait_all_ready`)."""
        found: dict[str, Any] = {}
        if event.startswith("api"):
            role, found["exit_code"] = self.replace_role(self.apis, event, stop_timeout=40)
            if wait_ready:
                self.wait_api(role)
                if self.haproxy is not None:
                    self.haproxy.wait_up((HAPROXY_SERVERS[self.apis.index(role)],))
        elif event.startswith("worker"):
            role, found["exit_code"] = self.replace_role(self.workers, event, stop_timeout=120)
            if wait_ready:
                self.wait_worker(role)
        elif event == "beat-leader":
            found.update(self.replace_leader(kill=False, wait_ready=wait_ready))
        elif event == "redis-failover":
            found["sentinels_named_new_master_s"] = round(self.redis.failover(), 2)
            if wait_ready:
                self.redis.wait_replica_synced()
        elif event == "postgres":
            self.postgres.stop("fast")
            time.sleep(1.0)
            self.postgres.start()
        else:
            raise ValueError(f"unknown event {event!r}")
        found["ready_at"] = time.monotonic()
        return found

    def replace_role(self, roles: list[Role], name: str, *, stop_timeout: float) -> tuple[Role, int | None]:
        """Stop the process of role ``name`` (SIGTERM: a graceful drain; SIGKILL after
        ``stop_timeout``) and start a new one in its place; the role and the old one's exit code."""
        role = next(r for r in roles if r.name == name)
        assert role.service is not None
        exit_code = role.service.stop(timeout=stop_timeout)
        role.start(self.logs)
        return role, exit_code

    def wait_all_ready(self, *, beat_leading: bool = False) -> None:
        """Every process ready: at the start (``beat_leading``: and one beat leads), and again after
        restarts that did not wait."""
        for role in self.workers:
            self.wait_worker(role)
        for role in self.apis:
            self.wait_api(role)
        if self.haproxy is not None:
            self.haproxy.wait_up(tuple(HAPROXY_SERVERS[: len(self.apis)]))
        if self.beats:
            wait_until(lambda: ((not beat_leading or self.leader() is not None)
                                and len(self.beat_members()) == len(self.beats)),
                       timeout=120, interval=0.2,
                       what="the beats (one leading)" if beat_leading else "every beat")

    def replace_leader(self, *, kill: bool, wait_ready: bool = True) -> dict[str, Any]:
        """Stop (SIGTERM) or kill (SIGKILL) the leader; the seconds until another beat leads; a new
        standby in its place."""
        role = self.leader_role()
        old = self.leader()
        assert role.service is not None
        began = time.monotonic()
        if kill:
            role.service.kill()
        else:
            role.service.signal(15)
        wait_until(lambda: self.leader() not in (None, old), timeout=60, interval=0.02,
                   what="another beat to lead")
        took = time.monotonic() - began
        if not kill:
            role.service.stop(timeout=30)
        role.start(self.logs)
        if wait_ready:
            wait_until(lambda: len(self.beat_members()) == len(self.beats), timeout=120, interval=0.2,
                       what="the new standby")
        return {"takeover_s": round(took, 2), "how": "SIGKILL" if kill else "SIGTERM"}


# --- the clients -----------------------------------------------------------------------------------------


@dataclass
class Record:
    at: float  # monotonic, when the request was sent
    kind: str  # submit | poll
    outcome: str  # "202", "503+retry-after", "503", "transport:ReadError" ...
    seconds: float


class Load:
    """``clients`` asyncio clients in a thread of their own: submit, long-poll to the end, again."""

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self.clients = clients
        self.records: list[Record] = []
        self.accepted: dict[str, float] = {}  # job id -> when accepted
        self.unfinished: set[str] = set()
        self.refused: Counter[str] = Counter()  # a submit given up (a 4xx other than 429/409)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _note(self, kind: str, began: float, response: httpx.Response | None, exc: Exception | None) -> str:
        if exc is not None:
            outcome = f"transport:{type(exc).__name__}"
        else:
            assert response is not None
            outcome = str(response.status_code)
            if response.status_code == 503:
                outcome += "+retry-after" if response.headers.get("retry-after") else ""
        self.records.append(Record(began, kind, outcome, time.monotonic() - began))
        return outcome

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=self.clients * 2, max_keepalive_connections=self.clients * 2)
        async with httpx.AsyncClient(base_url=self.url, timeout=60, limits=limits) as client:
            await asyncio.gather(*(self._client(client, index) for index in range(self.clients)))

    async def _client(self, client: httpx.AsyncClient, index: int) -> None:
        serial = 0
        while not self._stop.is_set():
            serial += 1
            body = {"kind": "generate", "input": {"prompt": "The quick brown fox"},
                    "params": {**JOB_PARAMS, "seed": index * 100_000 + serial}}
            key = str(uuid.uuid4())
            job_id = await self._submit(client, body, key)
            if job_id is None:
                continue
            await self._follow(client, job_id)

    async def _submit(self, client: httpx.AsyncClient, body: dict[str, Any], key: str) -> str | None:
        while True:  # even after stop: a submit whose answer was lost is repeated until known
            began = time.monotonic()
            response: httpx.Response | None = None
            try:
                response = await client.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
                outcome = self._note("submit", began, response, None)
            except httpx.TransportError as exc:
                outcome = self._note("submit", began, None, exc)
            if response is not None and response.status_code in (200, 202):
                job_id = str(response.json()["id"])
                self.accepted.setdefault(job_id, time.monotonic())
                return job_id
            if response is not None and response.status_code not in (429, 503) and response.status_code < 500:
                self.refused[outcome] += 1
                return None
            if self._stop.is_set() and response is not None and response.status_code in (429, 503):
                return None  # refused, not accepted: nothing to learn
            wait = 0.5
            if response is not None:
                with contextlib.suppress(ValueError):
                    wait = min(5.0, float(response.headers.get("retry-after", 0.5)))
            await asyncio.sleep(wait)

    async def _follow(self, client: httpx.AsyncClient, job_id: str) -> None:
        self.unfinished.add(job_id)
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                response = await client.get(f"/v1/jobs/{job_id}", params={"wait": 10})
                self._note("poll", began, response, None)
            except httpx.TransportError as exc:
                self._note("poll", began, None, exc)
                await asyncio.sleep(0.5)
                continue
            if response.status_code == 200 and response.json().get("status") in FINAL:
                self.unfinished.discard(job_id)
                return
            if response.status_code != 200:
                await asyncio.sleep(0.5)


# --- checks ---------------------------------------------------------------------------------------------


def p99(values: Sequence[float]) -> float | None:
    if not values:
        return None
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def check_jobs(fleet: Fleet, accepted: list[str], timeout: float) -> dict[str, Any]:
    """Wait until every accepted job is final in SQL; the exactly-once checks."""
    ids = sorted(set(accepted))

    def rows() -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        with fleet.engine.connect() as conn:
            for start in range(0, len(ids), 1000):
                chunk = [uuid.UUID(j) for j in ids[start:start + 1000]]
                result = conn.execute(text(
                    "SELECT id, status, attempt, max_attempts, (result IS NOT NULL) AS has_result "
                    "FROM jobs WHERE id = ANY(:ids)"), {"ids": chunk})
                for row in result.mappings():
                    found[str(row["id"])] = dict(row)
        return found

    deadline = time.monotonic() + timeout
    while True:
        try:
            found = rows()
        except Exception:
            found = {}
        pending = [j for j in ids if found.get(j, {}).get("status") not in FINAL]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    writes: dict[str, list[tuple[int, str]]] = defaultdict(list)
    with fleet.engine.connect() as conn:
        outcomes = conn.execute(text("SELECT job_id, attempt, status FROM fleet_outcome_writes"))
        for job_id, attempt, status in outcomes:
            writes[str(job_id)].append((int(attempt), str(status)))
        total_jobs = int(conn.execute(text("SELECT count(*) FROM jobs")).scalar_one())
    missing = [j for j in ids if j not in found]
    statuses = Counter(str(found[j]["status"]) for j in ids if j in found)
    not_once = {j: writes.get(j, []) for j in ids if j in found and len(writes.get(j, [])) != 1}
    stale = [j for j in ids if len(writes.get(j, [])) == 1 and writes[j][0][0] != found[j]["attempt"]]
    bad_attempts = [j for j in ids if j in found
                    and not 1 <= int(found[j]["attempt"]) <= int(found[j]["max_attempts"])]
    no_result = [j for j in ids
                 if j in found and found[j]["status"] == "succeeded" and not found[j]["has_result"]]
    attempts = Counter(int(found[j]["attempt"]) for j in ids if j in found)
    report = {
        "accepted": len(ids), "statuses": dict(statuses), "missing": len(missing), "not_final": len(pending),
        "not_exactly_one_outcome": len(not_once), "outcome_by_other_attempt": len(stale),
        "attempts_out_of_range": len(bad_attempts), "succeeded_without_result": len(no_result),
        "attempts": {str(k): v for k, v in sorted(attempts.items())},
        "jobs_in_sql_unknown_to_clients": total_jobs - len(ids),
        "examples": {"missing": missing[:3], "not_final": pending[:3],
                     "not_once": dict(list(not_once.items())[:3])},
    }
    report["ok"] = bool(ids) and not (missing or pending or not_once or stale or bad_attempts
                                      or no_result) and statuses.get("succeeded", 0) == len(ids)
    return report


_DUE = re.compile(r"Sending due task (\S+) \((\S+)\)")
_TASK = re.compile(r"Task (cloverq\.\w+)\[([0-9a-f-]+)\] (received|succeeded|raised|failed|ignored)")
# scheduler/infra/periodic_tick.py's reasons to drop a tick, as the report names them
_DROP_EVENTS = {"tick.redelivery_dropped": "claimed before", "tick.stale_leader_dropped": "stale leader",
                "tick.claim_failed": "no database", "tick.fence_check_failed": "no Redis"}


def _reasons(why: dict[str, int]) -> str:
    """``(claimed before 1, no database 2)``; empty for none."""
    return f"({', '.join(f'{name} {count}' for name, count in sorted(why.items()))})" if why else ""


def _stamp(record: dict[str, Any]) -> float | None:
    value = record.get("timestamp")
    if not isinstance(value, str):
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def count_periodic(fleet: Fleet, intervals: dict[str, float]) -> dict[str, Any]:
    """Per periodic task, from every beat process's log (see the module docstring)."""
    dispatches: dict[str, list[tuple[float, str]]] = defaultdict(list)
    received: Counter[tuple[str, str]] = Counter()
    finished: Counter[tuple[str, str]] = Counter()
    dropped: Counter[tuple[str, str]] = Counter()  # Celery's "ignored": a tick dropped, not run
    # why, by (event, task): periodic_tick's drop events (a claimed id, a superseded leadership, a
    # check that could not be made: the database or Redis away)
    drops: Counter[tuple[str, str]] = Counter()
    acquired: list[tuple[float, str]] = []
    last_seen = 0.0  # the latest log line of any beat: the end of the counted time
    for role in fleet.beats:
        for service in role.services():
            for line in service.log().splitlines():
                if not line.startswith("{"):
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                event = str(record.get("event", ""))
                at = _stamp(record)
                if at is None:
                    continue
                last_seen = max(last_seen, at)
                due = _DUE.search(event)
                if due:
                    dispatches[due.group(1)].append((at, service.name))
                elif event == "beat.leader_acquired":
                    acquired.append((at, service.name))
                elif event in _DROP_EVENTS:
                    drops[(event, str(record.get("task")))] += 1
                got = _TASK.search(event)
                if got:
                    outcome = got.group(3)
                    counter = {"received": received, "ignored": dropped}.get(outcome, finished)
                    counter[(got.group(1), got.group(2))] += 1
    changes = max(0, len(acquired) - 1)  # the first acquisition is the start, not a change
    tasks: dict[str, Any] = {}
    ok = True
    for name, interval in sorted(intervals.items()):
        times = sorted(dispatches.get(name, []))
        same_short = sum(1 for (a, pa), (b, pb) in itertools.pairwise(times)
                         if pa == pb and b - a < interval / 2)
        handovers = sum(1 for (_, pa), (_, pb) in itertools.pairwise(times) if pa != pb)
        max_gap = max((b - a for (a, _), (b, _) in itertools.pairwise(times)), default=0.0)
        # what one leader at a time should have sent: from the first leadership to the last line read
        led = (last_seen - min(acquired)[0]) if acquired else 0.0
        expected = led / interval
        task = f"cloverq.{name.replace('-', '_')}"
        executions = sum(1 for (task_name, _) in finished if task_name == task)
        duplicate_executions = sum(count - 1 for (task_name, _), count in finished.items()
                                   if task_name == task and count > 1)
        redeliveries = sum(count - 1 for (task_name, _), count in received.items()
                           if task_name == task and count > 1)
        ignored = sum(count for (task_name, _), count in dropped.items() if task_name == task)
        why = {_DROP_EVENTS[event]: count for (event, task_name), count in drops.items() if task_name == task}
        # none twice, and none missing: a task whose period fits the run was sent about as often as
        # the leaders' time allows (a restart's hand-over may cost a period or two)
        enough = interval >= led or len(times) >= 0.8 * expected - 2
        row_ok = same_short == 0 and handovers <= changes and duplicate_executions == 0 and enough
        ok = ok and row_ok
        tasks[name] = {"interval_s": interval, "dispatched": len(times), "expected_about": round(expected, 1),
                       "by_process": dict(Counter(p for _, p in times)),
                       "short_gaps_same_process": same_short,
                       "handovers": handovers, "max_gap_s": round(max_gap, 2), "executions": executions,
                       "duplicate_executions": duplicate_executions, "redeliveries": redeliveries,
                       "dropped": ignored, "dropped_by_reason": why,
                       "ok": row_ok}
    return {"leader_changes": changes, "leaders": [p for _, p in acquired], "tasks": tasks, "ok": ok}


def schedule_intervals(fleet: Fleet) -> dict[str, float]:
    from scheduler.infra.beat_schedule import beat_schedule

    return {name: float(entry["schedule"]) for name, entry in beat_schedule(fleet.settings).items()}


def summarize_errors(records: list[Record]) -> dict[str, Any]:
    errors = Counter(f"{r.kind} {r.outcome}" for r in records if not r.outcome.startswith("2"))
    server = {k: v for k, v in errors.items() if k.split(" ", 1)[1][:1] == "5" and "+retry-after" not in k}
    return {"requests": len(records), "by_kind": dict(sorted(errors.items())), "forbidden_5xx": server,
            "ok": not server}


# --- runs ------------------------------------------------------------------------------------------------


@dataclass
class Window:
    name: str
    start: float
    end: float
    detail: dict[str, Any] = field(default_factory=dict)


def _window_latency(records: list[Record], window: Window) -> dict[str, Any]:
    inside = [r for r in records if r.kind == "submit" and window.start <= r.at < window.end]
    ok = [r.seconds for r in inside if r.outcome in ("200", "202")]
    value = p99(ok)
    return {"window": window.name, "seconds": round(window.end - window.start, 1), "submits": len(inside),
            "accepted": len(ok), "not_accepted": len(inside) - len(ok),
            "p99_ms": round(value * 1000, 1) if value is not None else None, **window.detail}


def run_fleet(options: FleetOptions, say: Callable[[str], None] = print) -> dict[str, Any]:
    root = options.workdir or Path(tempfile.mkdtemp(prefix="cloverq-fleet-"))
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)  # the postgres user reaches its cluster below
    fleet = Fleet(root, options, say)
    try:
        fleet.start()
        if options.beats_only:
            return _beats_only(fleet, options, say)
        return _under_load(fleet, options, say)
    finally:
        fleet.stop()
        if not options.keep:
            shutil.rmtree(root, ignore_errors=True)


def _under_load(fleet: Fleet, options: FleetOptions, say: Callable[[str], None]) -> dict[str, Any]:
    assert fleet.haproxy is not None
    load = Load(fleet.haproxy.url, options.clients)
    began = time.monotonic()
    load.start()
    slot = max(1.0, (options.seconds - options.warmup_seconds) / (len(options.events) + 1))
    time.sleep(options.warmup_seconds)
    baseline = Window("baseline (quiet)", time.monotonic(), time.monotonic() + slot)
    time.sleep(slot)
    windows: list[Window] = []
    for number, event in enumerate(options.events, start=1):
        due = began + options.warmup_seconds + slot * number
        time.sleep(max(0.0, due - time.monotonic()))
        if not options.wait_ready and event == "postgres":  # no process starts during the outage
            fleet.wait_all_ready()
        say(f"[{time.monotonic() - began:6.1f} s] restart {event}")
        start = time.monotonic()
        detail = fleet.restart(event, wait_ready=options.wait_ready)
        ready_at = detail.pop("ready_at")
        windows.append(Window(f"restart {event}", start, ready_at + SETTLE_SECONDS,
                              {"restart_s": round(ready_at - start, 1), **detail}))
        say(f"[{time.monotonic() - began:6.1f} s]   {event} back after {ready_at - start:.1f} s "
            f"{detail or ''}")
    if not options.wait_ready:
        fleet.wait_all_ready()
        say(f"[{time.monotonic() - began:6.1f} s] every process ready again")
    time.sleep(max(SETTLE_SECONDS, began + options.seconds - time.monotonic()))
    load.stop()
    ended = time.monotonic()
    jobs = check_jobs(fleet, list(load.accepted), timeout=180)
    periodic = count_periodic(fleet, schedule_intervals(fleet))
    errors = summarize_errors(load.records)
    latency = [_window_latency(load.records, window) for window in [baseline, *windows]]
    report = {
        "mode": "fleet", "seconds": round(ended - began, 1), "clients": options.clients,
        "processes": {"apis": len(fleet.apis), "workers": len(fleet.workers), "beats": len(fleet.beats),
                      "redis": "master + replica + 3 sentinels", "postgres": 1, "haproxy": 1},
        "cores": available_cpus(), "jobs": jobs, "errors": errors, "submit_latency": latency,
        "periodic": periodic, "submits_given_up": dict(load.refused),
    }
    report["ok"] = bool(jobs["ok"] and errors["ok"] and periodic["ok"] and not load.refused)
    return report


def _beats_only(fleet: Fleet, options: FleetOptions, say: Callable[[str], None]) -> dict[str, Any]:
    began = time.monotonic()
    say(f"two beats for {options.seconds:.0f} s ...")
    time.sleep(options.seconds)
    periodic = count_periodic(fleet, schedule_intervals(fleet))
    # Once per period: no period skipped (a gap under 1.5 intervals) and none run twice (above).
    skipped = {name: row["max_gap_s"] for name, row in periodic["tasks"].items()
               if row["max_gap_s"] > 1.5 * row["interval_s"]}
    lease = float(fleet.settings.beat.lease_seconds)
    bound = lease * 4 / 3
    takeover = fleet.replace_leader(kill=True)
    report = {
        "mode": "beats-only", "seconds": round(time.monotonic() - began, 1), "periodic": periodic,
        "takeover": {**takeover, "lease_s": lease, "bound_s": round(bound, 2),
                     "within_bound": takeover["takeover_s"] <= bound},
    }
    report["periods_skipped"] = skipped
    report["ok"] = bool(periodic["ok"] and periodic["leader_changes"] == 0 and not skipped
                        and takeover["takeover_s"] <= bound)
    return report


# --- printing and the command -------------------------------------------------------------------------------


def render(report: dict[str, Any]) -> str:
    out: list[str] = []
    periodic = report["periodic"]
    if report["mode"] == "fleet":
        jobs, errors = report["jobs"], report["errors"]
        out.append(f"fleet: {report['processes']}, {report['clients']} clients, {report['seconds']} s, "
                   f"{report['cores']} cores")
        out.append(f"jobs: {jobs['accepted']} accepted; statuses {jobs['statuses']}; "
                   f"missing {jobs['missing']}; not final {jobs['not_final']}; "
                   f"not exactly one outcome {jobs['not_exactly_one_outcome']}; "
                   f"outcome by another attempt {jobs['outcome_by_other_attempt']}; "
                   f"attempts {jobs['attempts']}; "
                   f"succeeded without result {jobs['succeeded_without_result']}; "
                   f"in SQL but unknown to clients {jobs['jobs_in_sql_unknown_to_clients']}")
        out.append(f"requests: {errors['requests']}; not 2xx by kind: {errors['by_kind'] or 'none'}; "
                   f"5xx other than 503+Retry-After: {errors['forbidden_5xx'] or 'none'}")
        out.append("submit latency (one POST through HAProxy, accepted answers; x: p99 over the baseline's):")
        base = next((row["p99_ms"] for row in report["submit_latency"]
                     if row["window"].startswith("baseline")), None)
        for row in report["submit_latency"]:
            ratio = f" x{row['p99_ms'] / base:.2f}" if base and row["p99_ms"] is not None else ""
            extra = {k: v for k, v in row.items()
                     if k not in ("window", "seconds", "submits", "accepted", "not_accepted", "p99_ms")}
            out.append(f"  {row['window']:26s} {row['seconds']:6.1f} s  {row['submits']:6d} submits  "
                       f"{row['not_accepted']:4d} not accepted  p99 {row['p99_ms']} ms{ratio}  {extra or ''}")
    else:
        take = report["takeover"]
        out.append(f"beats only: {report['seconds']} s; leader {take['how']} -> standby led after "
                   f"{take['takeover_s']} s (bound lease x 4/3 = {take['bound_s']} s): "
                   f"{'within' if take['within_bound'] else 'OVER'}; periods skipped: "
                   f"{report.get('periods_skipped') or 'none'}")
    out.append(f"periodic work (Celery beat 'Sending due task' lines per task; leader changes "
               f"{periodic['leader_changes']}):")
    for name, row in periodic["tasks"].items():
        out.append(f"  {name:16s} every {row['interval_s']:6.1f} s  dispatched {row['dispatched']:5d} "
                   f"(expected about {row['expected_about']})  executions {row['executions']:5d}  "
                   f"same-process short gaps {row['short_gaps_same_process']}  "
                   f"hand-overs {row['handovers']}  max gap {row['max_gap_s']} s  "
                   f"run twice {row['duplicate_executions']}  redelivered {row['redeliveries']} "
                   f"dropped {row['dropped']} {_reasons(row['dropped_by_reason'])}  "
                   f"{'ok' if row['ok'] else 'DUPLICATE'}")
    out.append(f"result: {'OK' if report['ok'] else 'FAILED'}")
    return "\n".join(out)


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=None, help="load time (default 300; beats-only 600)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--events", default=",".join(EVENTS),
                        help=f"restarts, in order (of {', '.join(EVENTS)})")
    parser.add_argument("--beats-only", action="store_true",
                        help="two beats, counts per period, then the leader killed")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temp dir, removed afterwards")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = _arguments(argv)
    seconds = args.seconds if args.seconds is not None else (600.0 if args.beats_only else 300.0)
    events = tuple(e for e in args.events.split(",") if e)
    unknown = [e for e in events if e not in EVENTS]
    if unknown:
        raise SystemExit(f"unknown events {unknown} (known: {', '.join(EVENTS)})")
    options = FleetOptions(seconds=seconds, clients=args.clients, events=events, beats_only=args.beats_only,
                           workdir=args.workdir, keep=args.keep or args.workdir is not None)
    if args.beats_only:
        options.apis = options.workers = 0
    report = run_fleet(options, say=lambda line: print(line, flush=True))
    print(render(report), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()

