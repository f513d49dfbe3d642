"""``python -m bench.demo_quality``: the trained demo's decision quality in-process, on the engine path.

``cloverq model eval`` submits the evaluation suite as jobs to a running stack; this scores the
same cases (``worker.training.corpus``, same seed and count by default) without one: the
checkpoint is loaded with ``load_checkpoint``, an ``Engine`` is started in this process and every
case runs through ``worker.decisions.run_decision`` (the planner, the infill template, the slot
scoring, ``assemble_result``) as ``worker.decide_job`` runs it, with the family's default
decoding (what a ``decide`` job without params gets when ``default_steps_per_block`` is unset) and
the joint decode a worker would resolve (``--joint-decode``, ``CLOVERQ_DECIDE_JOINT_DECODE``'s
values; ``auto``: the checkpoint's declaration). ``--constraints``: joint decisions declare each
question group's rule.
The tallies are ``worker.training.evaluation.DecisionTally``'s; the answer distribution per
question (first or second of its group, choices yes/no or yes/no/n.a.) shows a constant answerer,
and the majority-class baseline (always the commonest true answer of that question type) is
printed next to it.

``--extraction N`` also runs N extraction cases per split through the worker's extract handler:
field accuracy, every field right, schema-valid. ``--tools N`` runs N tool-call cases per split
through the worker's generate handler (the chat with the tools, ``tool_choice`` auto, the parser):
the right call, no call for a question. ``--generation N`` also decodes N generation
cases (thinking as the case says, 48 new tokens) with one token per pass and with ``dynamic`` at
0.9: tokens per pass and the exact-line score. Run it niced with one torch thread on the shared machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import threading
import time
from pathlib import Path

import torch

from scheduler.infra.settings import Settings
from worker.decide_job import resolve_joint_decode
from worker.decisions import DecisionSpec, run_decision
from worker.decisions.runner import DecisionOptions
from worker.engine.engine import Engine, EngineConfig
from worker.engine.types import GenerationRequest, SamplingParams
from worker.execution import run_kind
from worker.job_handler import EngineContext, JobSpec
from worker.model.checkpoint import LoadedModel, load_checkpoint
from worker.model.hf_defaults import GenerationDefaults
from worker.model.tokenizer import Tokenizer
from worker.training.corpus import decision_cases, extraction_cases, generation_cases, tool_call_cases
from worker.training.evaluation import DecisionTally, ExtractionTally, GenerationTally, ToolCallTally, retries
from worker.training.rows import MODES, generation_prompt
from worker.training.tool_calls import TOOL_TOKENS


def decision_report(
    engine: Engine, tokenizer: Tokenizer, split: str, seed: int, count: int, headings: bool = False,
    joint_one_pass: bool = False, constraints: bool = False,
) -> dict[str, object]:
    cases = decision_cases(split, seed, count, headings=headings)  # type: ignore[arg-type]
    report: dict[str, object] = {}
    truth: collections.Counter[tuple[str, str]] = collections.Counter()
    for case in cases:
        for group in case.groups:
            for k, q in enumerate(group.questions):
                truth[(f"q{k + 1}/{len(q.choices)}", q.answer)] += 1
    majority: dict[str, int] = collections.defaultdict(int)
    for (kind, _), n in truth.items():
        majority[kind] = max(majority[kind], n)
    questions = sum(truth.values())
    report["majority_baseline"] = round(sum(majority.values()) / questions, 4)
    report["truth"] = {f"{k}={a}": n for (k, a), n in sorted(truth.items())}
    for mode in MODES:
        tally = DecisionTally()
        given: collections.Counter[str] = collections.Counter()
        for i, case in enumerate(cases):
            spec = DecisionSpec.from_input(case.job_input(mode, constraints))
            outcome = run_decision(
                spec,
                tokenizer=tokenizer,  # type: ignore[arg-type]  # the worker Tokenizer has every member
                submit=engine.submit,
                request_id=f"eval{i}",
                params=SamplingParams(max_new_tokens=1),
                slot_class="standard",
                submit_many=engine.submit_many,
                options=DecisionOptions(joint_one_pass=joint_one_pass),
            )
            answers = None
            if outcome.result is not None:
                answers = [str(a["choice"]) for a in outcome.result["answers"]]
                flat = [(k, q) for g in case.groups for k, q in enumerate(g.questions)]
                for (k, q), a in zip(flat, answers, strict=True):
                    given[f"q{k + 1}/{len(q.choices)}={a}"] += 1
            tally.add(case, answers, max(0, outcome.attempts - 1))
        report[mode] = {**tally.as_dict(), "answers": dict(sorted(given.items()))}
    return report


def extraction_report(
    engine: Engine, tokenizer: Tokenizer, split: str, seed: int, count: int, headings: bool = False
) -> dict[str, object]:
    """Each case through the worker's own handler (``worker.execution.run_kind``: the extract
    prompt, the schema's canvas, the value read back), on this engine."""
    cases = extraction_cases(split, seed, count, headings=headings)  # type: ignore[arg-type]
    tally = ExtractionTally()
    ctx = _context(engine, tokenizer)
    for i, case in enumerate(cases):
        outcome = run_kind(JobSpec(f"x{i}", "extract", "standard", 1, case.job_input(), {}), ctx)
        tally.add(case, outcome.result.get("data") if outcome.result is not None else None)
    return tally.as_dict()


def _context(engine: Engine, tokenizer: Tokenizer) -> EngineContext:
    """What the worker hands a job's handler, on this engine (no deadline, no progress)."""
    return EngineContext(submit=engine.submit, tokenizer=tokenizer, settings=Settings(), deadline=None,  # type: ignore[arg-type]
                         cancel_event=threading.Event(), on_progress=lambda _: None,
                         default_block_size=engine.default_block_size)  # fmt: skip


def tool_call_report(
    engine: Engine, tokenizer: Tokenizer, split: str, seed: int, count: int, headings: bool = False,
    tool_choice: str = "auto",
) -> dict[str, object]:
    """Each case as a ``generate`` job with its tools through the worker's own handler (the chat
    template with the tools, the call parser for ``auto``; for ``required`` the name a choice slot
    and the arguments a canvas), 96 new tokens."""
    tally = ToolCallTally()
    ctx = _context(engine, tokenizer)
    for i, case in enumerate(tool_call_cases(split, seed, count, headings=headings)):  # type: ignore[arg-type]
        body = {**case.job_input(), "tool_choice": tool_choice}
        job = JobSpec(f"t{i}", "generate", "standard", 1, body, {"max_new_tokens": TOOL_TOKENS})
        outcome = run_kind(job, ctx)
        result = outcome.result or {}
        tally.add(case, result.get("text") if outcome.result is not None else None, result.get("tool_calls"),
                  retries(result.get("usage")))
    return tally.as_dict()


# how the generation suite decodes a case (bench.tpp_bound decodes it the same way)
GENERATION_MAX_NEW = 48  # new tokens


def generation_report(
    engine: Engine, tokenizer: Tokenizer, seed: int, count: int, block: int, headings: bool = False
) -> dict[str, object]:
    """The generation suite's score and tokens per pass, one token per pass and ``dynamic`` 0.9.

    Both run ``block`` (the checkpoint's block size) steps per block, as ``cloverq model eval``
    does: ``static`` then commits one token per pass, and ``dynamic``'s fallback one (fewer steps
    would make its fallback commit several unsure tokens a pass and count them as parallel)."""
    cases = generation_cases("eval", seed, count, headings=headings)
    configs = {
        "static 1/pass": SamplingParams(max_new_tokens=GENERATION_MAX_NEW, strategy="static",
                                        steps_per_block=block),
        "dynamic 0.9": SamplingParams(max_new_tokens=GENERATION_MAX_NEW, strategy="dynamic", threshold=0.9,
                                      steps_per_block=block),
    }
    report: dict[str, object] = {}
    for label, params in configs.items():
        tally = GenerationTally()
        requests = [
            GenerationRequest(f"g{i}", generation_prompt(c, tokenizer), params) for i, c in enumerate(cases)
        ]
        for case, future in zip(cases, engine.submit_many(requests), strict=True):
            r = future.result()
            text = tokenizer.decode(r.token_ids, skip_special_tokens=True)
            if case.thinking and "</think>" in text:
                text = text.split("</think>", 1)[1]
            tally.add(case, text, r.tokens, r.steps_used)
        report[label] = tally.as_dict()
    return report


def served_joint_decode(lm: LoadedModel, setting: str = "auto") -> str:
    """The joint decode a worker serving ``lm`` runs with under ``setting`` (its declaration)."""
    return resolve_joint_decode(setting, GenerationDefaults.from_dict(lm.generation_config).joint_decode)


def started_engine(lm: LoadedModel) -> Engine:
    """A started engine over ``lm`` (eval mode) as this module scores on: 16 rows, 2048 positions,
    the checkpoint's mask, EOS and block size. The caller stops it."""
    lm.model.eval()
    assert lm.config.mask_token_id is not None
    engine = Engine(
        lm.model,
        EngineConfig(max_batch=16, max_len=2048),
        mask_token_id=lm.config.mask_token_id,
        eos_token_ids=lm.config.eos_token_ids,
        default_block_size=lm.config.block_size,
    )
    engine.start()
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("worker/model/demo_trained/clover"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--count", type=int, default=60)
    parser.add_argument("--splits", default="eval", help="comma-separated: eval, heldout")
    parser.add_argument("--generation", type=int, default=0)
    parser.add_argument("--extraction", type=int, default=0, help="extraction cases per split")
    parser.add_argument("--tools", type=int, default=0, help="tool-call cases per split")
    parser.add_argument("--tool-choice", default="auto", choices=("auto", "required"),
                        help="required: every case calls (a question then scores wrong)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--joint-decode", default="auto", choices=("auto", "blockwise", "one_pass"),
                        help="as CLOVERQ_DECIDE_JOINT_DECODE (auto: the checkpoint's)")  # fmt: skip
    parser.add_argument("--constraints", action="store_true",
                        help="joint decisions declare each group's rule as a constraint")  # fmt: skip
    parser.add_argument("--headings", action="store_true",
                        help="the headed corpus (a checkpoint trained with headings)")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_checkpoint(args.checkpoint, dtype=torch.float32)
    decode = served_joint_decode(lm, args.joint_decode)
    engine = started_engine(lm)
    began = time.monotonic()
    report: dict[str, object] = {"checkpoint": str(args.checkpoint), "seed": args.seed, "count": args.count,
                                 "joint_decode": decode, "constraints": args.constraints}
    try:
        for split in args.splits.split(","):
            report[split] = decision_report(engine, lm.tokenizer, split, args.seed, args.count, args.headings,
                                            joint_one_pass=decode == "one_pass", constraints=args.constraints)
            if args.extraction:
                report[f"extraction/{split}"] = extraction_report(
                    engine, lm.tokenizer, split, args.seed, args.extraction, args.headings
                )
            if args.tools:
                report[f"tools/{split}"] = tool_call_report(
                    engine, lm.tokenizer, split, args.seed, args.tools, args.headings, args.tool_choice
                )
        if args.generation:
            report["block_size"] = engine.default_block_size  # the generation decodes' blocks and steps
            report["generation"] = generation_report(
                engine, lm.tokenizer, args.seed, args.generation, engine.default_block_size, args.headings
            )
    finally:
        engine.stop()
    report["seconds"] = round(time.monotonic() - began, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
