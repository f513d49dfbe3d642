"""Joint vs independent decisions for bulk work, through a running stack (``cloverq up``).

The same N decisions (one context, Q yes/no questions each) are submitted once in each mode, all
at once as a pipeline would, and the run reports: wall time until every job is final, each job's
queue wait (``queued_ms``) and run time (``run_ms``), p50 and p95, and joint's figures as
ratios of independent's (the baseline, measured in the same run). It finds the stack the way the
CLI does (``--url``/``--key``, ``CLOVERQ_API_URL``/``KEY``, else the record ``cloverq up`` left).

    python -m bench.modes --jobs 10 --questions 20 --context-words 200
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from cli.api_client import resolve_target
from client import Client
from scheduler.infra.settings import get_settings

CONTRACT = ("the supplier shall deliver goods within thirty days of the order and the buyer shall pay "
            "each invoice within sixty days unless the parties agree otherwise in writing")
WORDS = CONTRACT.split(" ")


@dataclass
class ModeRun:
    mode: str
    wall_s: float
    queued_ms: list[float]
    run_ms: list[float]
    failed: int


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def run_mode(client: Client, mode: str, *, jobs: int, questions: int, context_words: int) -> ModeRun:
    context = " ".join(WORDS[i % len(WORDS)] for i in range(context_words))
    asked = [{"id": f"q{i}", "text": f"Does clause {i} oblige the supplier?"} for i in range(questions)]
    began = time.monotonic()
    ids = [client.decide(context, asked, mode=mode, metadata={"bench": "modes", "n": n}).id
           for n in range(jobs)]
    done = [client.wait(job_id, timeout=1800) for job_id in ids]
    wall = time.monotonic() - began
    return ModeRun(mode, wall, [j.timings.queued_ms or 0.0 for j in done],
                   [j.timings.run_ms or 0.0 for j in done], sum(j.status != "succeeded" for j in done))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--context-words", type=int, default=200)
    parser.add_argument("--url")
    parser.add_argument("--key")
    args = parser.parse_args()
    target = resolve_target(get_settings(), args.url, args.key)
    with Client(target.url, target.key, timeout=60.0) as client:
        runs = [run_mode(client, mode, jobs=args.jobs, questions=args.questions,
                         context_words=args.context_words) for mode in ("independent", "joint")]
    print(f"{args.jobs} decisions x {args.questions} questions, context {args.context_words} words, "
          f"at {target.url}")
    print(f"{'mode':12} {'wall s':>8} {'queue p50 ms':>13} {'queue p95 ms':>13} {'run p50 ms':>11} "
          f"{'run p95 ms':>11} {'failed':>6}")
    for run in runs:
        print(f"{run.mode:12} {run.wall_s:8.1f} {_pct(run.queued_ms, .5):13.0f} "
              f"{_pct(run.queued_ms, .95):13.0f} {_pct(run.run_ms, .5):11.0f} "
              f"{_pct(run.run_ms, .95):11.0f} {run.failed:6d}")
    base, joint = runs
    print(f"joint / independent: wall x{joint.wall_s / base.wall_s:.2f}, run p50 "
          f"x{statistics.median(joint.run_ms) / max(1e-9, statistics.median(base.run_ms)):.2f}")


if __name__ == "__main__":
    main()
