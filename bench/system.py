"""The whole stack against the engine alone, at saturation (``python -m bench.system``).

Issue 32: what does the stack (HTTP, admission, SQL, Redis, Celery, the job runner, monitor and
event stream) cost next to the engine it feeds? For each worker count (``--workers 1,2``) the same
work runs twice in the same run, on the same demo checkpoint and torch threads:

- **engine**: ``W`` processes, each the worker's own ``ResidentModel`` (the engine the worker
  builds, with its slots, interactive reserve included, warmed up the same way), each given its
  share of the jobs at once (the engine's queue is its saturation), prompts tokenized and params
  mapped by the worker's own helpers;
- **stack**: ``cloverq api`` + beat + ``W`` ``cloverq worker`` processes on a Redis of its own and
  a database (``--database-url``, default a SQLite file), every job submitted over HTTP at once
  and long-polled to its end.

Both report jobs/s and generated tokens/s over the wall time from the first job's start to the
last one's end (the stack's from the jobs' own ``created_at`` / ``finished_at``). The goal is the
stack at >= 90% of the engine's tokens/s. On a small CPU machine every process shares the same
cores, so the stack's own processes (API, beat, Redis, the database) take CPU from the engine:
the report prints, beside the ratio, the CPU each process used per job over the saturated phase
(``/proc``, ``bench/system_cpu.py``: the worker's beyond what the engine alone used on the same
jobs), the share of the machine they took, and the bound that leaves,
``engine tokens/s x (1 - share)``; and the engines' busy time, tokens per pass and the running
jobs per heartbeat, to tell CPU taken from a starved engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench import system_cpu
from bench.fleet_services import NO_REDIS_SERVER, free_port, redis_server_binary
from scheduler.infra.settings import available_cpus

PROMPT = "The quick brown fox jumps over the lazy dog and"
FINAL = ("succeeded", "failed", "cancelled")
HEARTBEAT_SECONDS = 2.0  # the workers' default worker_heartbeat_seconds (their registry entries)


@dataclass
class Measured:
    """One side of one comparison."""

    label: str
    workers: int
    jobs: int
    tokens: int
    seconds: float
    # CPU seconds per process group over the measured phase ("engine" for the engine alone; "api",
    # "beat", "redis", "client", "worker-N" for the stack), and the worker's busiest threads apart
    cpu: dict[str, float] = field(default_factory=dict)
    worker_top_threads: float = 0.0
    # the CPU seconds of the threads of the first engine process / of worker-0, most first
    worker_threads: list[float] = field(default_factory=list)
    cpu_wall: float = 0.0  # the wall seconds the CPU readings span
    engine_busy: float = 0.0  # seconds inside engine passes, summed over the engines
    passes: int = 0  # engine passes, summed
    batch: list[int] = field(default_factory=list)  # running jobs per heartbeat (stack, worker 0)
    foreign: float = 0.0  # CPU seconds the rest of the machine (not this run) used meanwhile

    @property
    def jobs_per_second(self) -> float:
        return self.jobs / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def job_params(index: int, args: argparse.Namespace) -> dict[str, Any]:
    return {"max_new_tokens": args.max_new_tokens, "steps_per_block": args.steps_per_block,
            "temperature": 0.0, "seed": index}


# --- the engine alone --------------------------------------------------------------------------


def engine_share(args: argparse.Namespace) -> dict[str, Any]:
    """This process's share of the jobs on the worker's engine; what ``--engine-share`` prints."""
    import redis
    import torch

    from scheduler.fleet.workers import WorkerInfo
    from scheduler.infra.settings import Settings
    from worker.class_gates import interactive_reserve
    from worker.engine.types import GenerationRequest
    from worker.execution import prompt_ids
    from worker.job_handler import sampling_params
    from worker.resident_model import ResidentModel

    settings = Settings(model_dir=args.checkpoint, torch_threads=args.threads, data_dir=args.workdir)
    torch.set_num_threads(settings.resolved_torch_threads)
    info = WorkerInfo(id="bench", hostname="bench", pid=os.getpid(), queues=["interactive"], state="starting")
    # the slots a worker on the default queues has: its batch plus the interactive reserve
    queues = [q for q in settings.worker.queues.split(",") if q]
    reserve = interactive_reserve(queues, settings.engine.interactive_reserve)
    resident = ResidentModel(settings, info=info, worker_id="bench", reserve=reserve,
                             redis_client=redis.Redis())  # never called: no tensor parallelism here
    resident.load(Path(args.checkpoint))
    assert resident.engine is not None and resident.tokenizer is not None
    requests = []
    for index in range(args.first, args.first + args.count):
        params = job_params(index, args)
        ids = prompt_ids({"prompt": PROMPT}, params, resident.tokenizer)
        requests.append(GenerationRequest(request_id=f"bench-{index}", prompt_ids=ids,
                                          params=sampling_params(params, settings), slot_class="interactive"))
    before = resident.engine.stats()
    threads_before = system_cpu.thread_seconds(os.getpid())
    machine_before = system_cpu.machine_busy()
    cpu_before = time.process_time()
    started = time.time()
    futures = [resident.engine.submit(request) for request in requests]
    tokens = sum(future.result().tokens for future in futures)
    ended = time.time()
    cpu = time.process_time() - cpu_before
    machine = system_cpu.machine_busy() - machine_before
    threads = system_cpu.thread_seconds(os.getpid())
    after = resident.engine.stats()
    resident.unload()
    return {"jobs": len(requests), "tokens": tokens, "started": started, "ended": ended, "cpu": cpu,
            "busy": after.busy_seconds - before.busy_seconds, "passes": after.passes - before.passes,
            "steps": after.steps - before.steps, "slots": after.max_batch, "machine": machine,
            "threads": sorted((max(0.0, t - threads_before.get(tid, 0.0)) for tid, t in threads.items()),
                              reverse=True)}


def run_engine(workers: int, args: argparse.Namespace) -> Measured:
    """``workers`` engine processes at once, the jobs split between them."""
    shares = [args.jobs // workers + (1 if i < args.jobs % workers else 0) for i in range(workers)]
    procs = []
    first = 0
    for count in shares:
        argv = [sys.executable, "-m", "bench.system", "--engine-share", "--checkpoint", str(args.checkpoint),
                "--first", str(first), "--count", str(count), "--threads", str(args.threads),
                "--max-new-tokens", str(args.max_new_tokens), "--steps-per-block", str(args.steps_per_block),
                "--workdir", str(args.workdir)]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
        first += count
    outs = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"engine share exited {proc.returncode}")
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    seconds = max(o["ended"] for o in outs) - min(o["started"] for o in outs)
    return Measured("engine", workers, sum(o["jobs"] for o in outs), sum(o["tokens"] for o in outs), seconds,
                    cpu={"engine": sum(o["cpu"] for o in outs)}, cpu_wall=seconds,
                    worker_threads=outs[0]["threads"],
                    foreign=max(0.0, outs[0]["machine"] - sum(o["cpu"] for o in outs)),
                    engine_busy=sum(o["busy"] for o in outs), passes=sum(o["passes"] for o in outs))


# --- the whole stack ---------------------------------------------------------------------------


class Stack:
    """Redis, migrations, API, beat and ``workers`` workers as subprocesses in ``workdir``."""

    def __init__(self, workers: int, args: argparse.Namespace) -> None:
        self.args = args
        self.workers = workers
        self.procs: list[subprocess.Popen[bytes]] = []
        self.names: list[str] = []
        self.port = free_port()
        self.redis_port = free_port()
        root = Path(args.workdir) / f"stack-{workers}"
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        database = args.database_url or f"sqlite:///{root / 'cloverq.db'}"
        self.env = {**os.environ, "CLOVERQ_DATABASE_URL": database,
                    "CLOVERQ_REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
                    "CLOVERQ_MODEL_DIR": str(args.checkpoint), "CLOVERQ_DATA_DIR": str(root),
                    "CLOVERQ_AUTH": "disabled", "CLOVERQ_RATE_LIMIT_PER_SECOND": "0",
                    "CLOVERQ_TENANT_MAX_ACTIVE_JOBS": "1000000",
                    "CLOVERQ_TORCH_THREADS": str(args.threads), "CLOVERQ_LOG_LEVEL": "WARNING"}

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.root / f"{name}.log").open("wb")
        self.procs.append(subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))
        self.names.append(name)

    def groups(self) -> dict[str, list[int]]:
        """The processes whose CPU the report counts, by name; the bench's own client is this one."""
        return {**{name: [proc.pid] for name, proc in zip(self.names, self.procs, strict=True)},
                "client": [os.getpid()]}

    def engines(self) -> list[dict[str, Any]]:
        """Each worker's registry entry (its heartbeat carries the engine's counters)."""
        import redis

        from scheduler.fleet.workers import list_workers

        client = redis.Redis(host="127.0.0.1", port=self.redis_port, decode_responses=True)
        try:
            return [{"at": w.heartbeat_at, "running": int(w.stats.get("running_jobs", 0)),
                     "busy": float(w.stats.get("engine_busy_seconds", 0.0)),
                     "passes": int(w.stats.get("engine_passes", 0)), "pid": w.pid}
                    for w in sorted(list_workers(client), key=lambda w: w.id)]
        finally:
            client.close()

    def start(self) -> None:
        redis_server = redis_server_binary()
        if redis_server is None:
            raise RuntimeError(NO_REDIS_SERVER)
        self._spawn("redis", [redis_server, "--port", str(self.redis_port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no", "--dir", str(self.root)])
        subprocess.run([sys.executable, "-m", "cli", "migrate"], env=self.env, check=True,
                       stdout=subprocess.DEVNULL)
        for index in range(self.workers):
            self._spawn(f"worker-{index}", [sys.executable, "-m", "cli", "worker"])
        self._spawn("beat", [sys.executable, "-m", "cli", "beat"])
        self._spawn("api", [sys.executable, "-m", "cli", "api", "--port", str(self.port)])
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                ready = httpx.get(f"{self.url}/readyz", timeout=2).json()
                if ready.get("ready") and ready["checks"]["workers"]["detail"] == f"{self.workers} ready":
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise SystemExit(f"the stack did not become ready (logs in {self.root})")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


async def _load(stack: Stack, args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[int]]:
    """Submit every job at once (a few connections), then long-poll each to its end; meanwhile read
    the workers' running jobs from the registry once a second (the batch over time)."""
    limits = httpx.Limits(max_connections=args.connections)
    batch: list[int] = []
    async with httpx.AsyncClient(base_url=stack.url, timeout=120, limits=limits) as client:
        async def submit(index: int) -> str:
            body = {"kind": "generate", "input": {"prompt": PROMPT}, "params": job_params(index, args)}
            answer = await client.post("/v1/jobs", json=body)
            answer.raise_for_status()
            return str(answer.json()["id"])

        async def final(job_id: str) -> dict[str, Any]:
            while True:
                answer = await client.get(f"/v1/jobs/{job_id}", params={"wait": 30})
                answer.raise_for_status()
                job: dict[str, Any] = answer.json()
                if job["status"] in FINAL:
                    return job

        async def sample() -> None:
            seen = 0.0
            while True:
                await asyncio.sleep(1.0)
                engines = await asyncio.to_thread(stack.engines)
                if engines and engines[0]["at"] != seen:  # a new heartbeat
                    seen = engines[0]["at"]
                    batch.append(sum(e["running"] for e in engines))

        sampler = asyncio.create_task(sample())
        try:
            ids = await asyncio.gather(*(submit(index) for index in range(args.jobs)))
            jobs = list(await asyncio.gather(*(final(job_id) for job_id in ids)))
        finally:
            sampler.cancel()
        return jobs, batch


def run_stack(workers: int, args: argparse.Namespace) -> Measured:
    stack = Stack(workers, args)
    watched = [f"worker-{index}" for index in range(workers)]
    try:
        stack.start()
        time.sleep(2 * HEARTBEAT_SECONDS)  # start-up settles (the beat's first ticks, warm-ups)
        engines_before = stack.engines()
        before = system_cpu.snapshot(stack.groups(), watch_threads=watched, alone=["client"])
        machine_before = system_cpu.machine_busy()
        began = time.monotonic()
        jobs, batch = asyncio.run(_load(stack, args))
        after = system_cpu.snapshot(stack.groups(), watch_threads=watched, alone=["client"])
        machine = system_cpu.machine_busy() - machine_before
        cpu_wall = time.monotonic() - began
        time.sleep(HEARTBEAT_SECONDS + 1.0)  # the next heartbeat carries the engines' last counters
        engines_after = stack.engines()
    finally:
        stack.stop()
    failed = [job["id"] for job in jobs if job["status"] != "succeeded"]
    if failed:
        raise SystemExit(f"{len(failed)} jobs did not succeed, e.g. {failed[:3]}")
    queues = {job["queue"] for job in jobs}
    if queues != {"interactive"}:  # the engine side runs them as interactive
        print(f"note: jobs routed to {sorted(queues)}", file=sys.stderr)
    started = min(_when(job["timings"]["created_at"]) for job in jobs)
    ended = max(_when(job["timings"]["finished_at"]) for job in jobs)
    tokens = sum(int((job.get("usage") or {}).get("completion_tokens", 0)) for job in jobs)
    used = system_cpu.usage(before, after, top=getattr(args, "engine_threads", args.threads))

    def grew(key: str) -> Any:
        return sum(e[key] for e in engines_after) - sum(e[key] for e in engines_before)

    return Measured("stack", workers, len(jobs), tokens, ended - started, cpu=used.seconds,
                    worker_top_threads=sum(used.top_threads.values()), cpu_wall=cpu_wall,
                    worker_threads=used.busiest.get("worker-0", []),
                    engine_busy=grew("busy"), passes=grew("passes"), batch=batch,
                    foreign=max(0.0, machine - sum(used.seconds.values())))


def explain(engine: Measured, stack: Measured, cores: int) -> dict[str, Any]:
    """Where the stack's CPU went next to the engine alone on the same jobs, and the bound it sets.

    The worker's CPU beyond what the engines alone spent on the same work is its own overhead
    (Celery, the monitor, SQL and Redis clients); with the API, beat, Redis and the bench client
    it is CPU the engines did not get. Their share of the machine (``cores x`` the measured wall
    time) bounds the stack at ``engine tokens/s x (1 - share)`` where the engine alone keeps
    every core busy."""
    jobs = max(1, stack.jobs)
    engine_cpu = engine.cpu.get("engine", 0.0) * stack.jobs / max(1, engine.jobs)
    workers = {k: v for k, v in stack.cpu.items() if k.startswith("worker-")}
    worker_cpu = sum(workers.values())
    others = {k: v for k, v in stack.cpu.items() if not k.startswith("worker-")}
    overhead = {"worker beyond the engine": max(0.0, worker_cpu - engine_cpu), **others}
    non_engine = sum(overhead.values())
    share, bound = system_cpu.bound(engine.tokens_per_second, non_engine, stack.cpu_wall, cores)
    bound_ratio = bound / engine.tokens_per_second if engine.tokens_per_second else 0.0
    machine = cores * stack.cpu_wall

    def ms(seconds: float) -> str:
        return f"{1000 * seconds / jobs:.0f}"

    alone_use = engine.cpu.get("engine", 0.0) / (cores * engine.seconds) if engine.seconds else 0.0
    lines = [
        f"CPU ms/job: engine alone {ms(engine_cpu)} ({alone_use:.0%} of the cores); stack worker(s) "
        f"{ms(worker_cpu)} (engine threads {ms(stack.worker_top_threads)}, others "
        f"{ms(worker_cpu - stack.worker_top_threads)}), "
        + ", ".join(f"{k} {ms(v)}" for k, v in sorted(others.items())),
        "threads' CPU ms per job of the run, busiest first: engine alone (one process) "
        + " ".join(ms(v) for v in engine.worker_threads[:8] if 1000 * v / jobs >= 0.5)
        + "; stack worker-0 " + " ".join(ms(v) for v in stack.worker_threads[:8] if 1000 * v / jobs >= 0.5),
        "non-engine CPU, share of the machine (" + f"{cores} cores x {stack.cpu_wall:.1f} s): "
        + ", ".join(f"{k} {v / machine:.1%}" for k, v in overhead.items()) + f" = {share:.1%}",
    ]
    alone_machine = cores * engine.cpu_wall or 1.0
    lines.append(f"the rest of the machine (not this run) took {engine.foreign / alone_machine:.0%} "
                 f"of the cores while the engine ran alone, {stack.foreign / machine:.0%} while the stack ran"
                 " (a loaded machine makes the ratio noise)")
    busy_alone = engine.engine_busy / (engine.seconds * engine.workers) if engine.seconds else 0.0
    busy_stack = stack.engine_busy / (stack.seconds * stack.workers) if stack.seconds else 0.0
    batch = sorted(stack.batch[1:-1] or stack.batch) or [0]
    lines.append(
        f"engine busy {busy_alone:.0%} of the wall alone, {busy_stack:.0%} in the stack; tokens/pass "
        f"{engine.tokens / max(1, engine.passes):.1f} alone, "
        f"{stack.tokens / max(1, stack.passes):.1f} in the stack; running jobs per heartbeat min "
        f"{batch[0]} median {batch[len(batch) // 2]} max {batch[-1]}")
    lines.append(f"bound: {engine.tokens_per_second:.1f} tokens/s x (1 - {share:.1%}) = {bound:.1f} tokens/s "
                 f"({bound_ratio:.1%} of the engine); the stack reached "
                 f"{stack.tokens_per_second / bound if bound else 0.0:.1%} of the bound")
    return {"lines": lines, "cpu_per_job_ms": {k: 1000 * v / jobs for k, v in stack.cpu.items()},
            "engine_cpu_per_job_ms": 1000 * engine_cpu / jobs, "non_engine_share": share,
            "bound_tokens_per_second": bound, "bound_ratio": bound_ratio}


def _when(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


# --- the command -----------------------------------------------------------------------------------


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.system", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2", help="worker counts to compare, comma-separated")
    parser.add_argument("--jobs", type=int, default=128, help="jobs per run")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--steps-per-block", type=int, default=4)
    parser.add_argument("--size", choices=("tiny", "small"), default="small", help="demo checkpoint size")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per engine (0: the cores / workers)")
    parser.add_argument("--connections", type=int, default=16, help="client connections to the API")
    parser.add_argument("--database-url", default=None, help="default: a SQLite file per run")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--engine-share", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = _arguments(argv)
    if args.engine_share:
        print(json.dumps(engine_share(args)), flush=True)
        return
    from worker.model.demo import write_demo_checkpoint

    # a SIGTERM unwinds like Ctrl-C: the stack's processes (sessions of their own) are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.workdir = Path(tempfile.mkdtemp(prefix="cloverq-bench-system-"))
    args.checkpoint = write_demo_checkpoint(args.workdir / "model" / args.size, seed=0, size=args.size)
    cores = available_cpus()  # the CPUs this process may use (a container's share), not the host's
    rows: list[dict[str, Any]] = []
    print(f"{cores} cores; {args.jobs} jobs of {args.max_new_tokens} tokens, {args.steps_per_block} steps "
          f"per block; demo checkpoint {args.size}", flush=True)
    threads = args.threads
    for workers in [int(part) for part in args.workers.split(",")]:
        args.threads = threads or max(1, cores // workers)  # the cores split between the engines
        engine = run_engine(workers, args)
        # the engine's compute threads: those of one engine process that did real work (its thread
        # and torch's OpenMP pool); the worker's as many busiest threads are its engine's
        busiest = engine.worker_threads[0] if engine.worker_threads else 0.0
        args.engine_threads = max(1, sum(1 for v in engine.worker_threads if v >= 0.05 * busiest))
        stack = run_stack(workers, args)
        ratio = stack.tokens_per_second / engine.tokens_per_second if engine.tokens_per_second else 0.0
        for side in (engine, stack):
            print(f"workers {workers}  {side.label:6s}  {side.jobs} jobs  {side.tokens} tokens  "
                  f"{side.seconds:7.2f} s  {side.jobs_per_second:7.2f} jobs/s  "
                  f"{side.tokens_per_second:8.1f} tokens/s", flush=True)
        explained = explain(engine, stack, cores)
        for line in explained.pop("lines"):
            print(f"workers {workers}  {line}", flush=True)
        print(f"workers {workers}  stack / engine tokens/s: {ratio:.1%} (torch threads {args.threads}); "
              f"CPU bound {explained['bound_ratio']:.1%}", flush=True)
        rows += [{**asdict(side), "jobs_per_second": side.jobs_per_second,
                  "tokens_per_second": side.tokens_per_second, "threads": args.threads}
                 for side in (engine, stack)]
        rows[-1].update(explained)
    if args.json is not None:
        args.json.write_text(json.dumps({"cores": cores, "rows": rows}, indent=2))
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
