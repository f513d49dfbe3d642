"""``cloverq model eval --suite decisions|generation|extraction|tools``: the demo's quality, through jobs.

Every case of the suite (``worker.training.corpus``, an evaluation split: contracts whose facts no
training contract has) is submitted as a real job to the running service (the Python client,
``cli/api_client.py``), waited for, and scored by ``worker.training.evaluation``:

- ``decisions``: each case as a ``decide`` job in ``independent`` and in ``joint`` mode, on the
  ``eval`` split (training's clause phrasings) and the ``heldout`` split (a phrasing of every
  clause that training never saw); side by side: accuracy, group all-correct, consistency
  violations, invalid-output retries, failed jobs.
- ``generation``: each case as a ``generate`` job (chat messages, thinking as the case says),
  decoded with one token per pass (``static``, steps = block size), then ``static`` with fewer
  steps and ``dynamic`` at thresholds 0.5 to 0.99: tokens per pass and the exact-line score.
- ``extraction``: each case as an ``extract`` job (a contract and a schema of two or three of its
  facts, ``worker.training.extraction``), on both splits: field accuracy, cases with every field
  right, values valid against the schema (judged by ``jsonschema``), failed jobs (and
  invalid-output retries, which an extract job never makes: its canvas decodes only valid values).
- ``tools``: each case as a ``generate`` job with the corpus's tools and ``tool_choice`` ``auto``
  (``worker.training.tool_calls``: a request that calls for one call, or a question to answer in
  text), on both splits: the right function, the right call (arguments too), no call for a
  question and its right line, malformed calls.

``--version V``: only jobs that ran on V count; a job a canary routed elsewhere at submit is
cancelled and submitted again (a canary pins each job by the hash of its id).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from cli.api_client import api_client
from client import Client, Job
from scheduler.infra.settings import Settings, get_settings
from worker.training.corpus import (
    DecisionCase,
    GenerationCase,
    Split,
    decision_cases,
    extraction_cases,
    generation_cases,
    tool_call_cases,
)
from worker.training.evaluation import DecisionTally, ExtractionTally, GenerationTally, ToolCallTally, retries
from worker.training.extraction import ExtractionCase
from worker.training.rows import MODES
from worker.training.tool_calls import TOOL_TOKENS, ToolCallCase

EVAL_SEED = 1  # any seed gives evaluation contracts (the split is by facts); this is the reported one
REROUTE_TRIES = 50


def served_block_size(settings: Settings) -> int:
    """The block size a worker under these settings decodes with when a job names none: its
    checkpoint's (the ``CLOVERQ_MODEL_DIR`` folder, or before ``cloverq up`` has copied it there,
    the shipped trained demo it will copy), resolved as the worker resolves it (``read_config``:
    ``config.json``, else ``generation_config.json``, then the family's default). The API does not
    report a model's block size, and the generation suite's decodings must follow it: with fewer
    steps than the block has positions, ``static`` and ``dynamic``'s fallback commit several tokens
    a pass, and tokens per pass would count them."""
    from worker.model.checkpoint import CheckpointError, read_config
    from worker.model.demo_trained import TRAINED_CLOVER_DEMO
    from worker.model.family import decoding_defaults

    folders = (settings.resolved_model_dir, TRAINED_CLOVER_DEMO)
    for folder in folders:
        try:
            return decoding_defaults(read_config(folder)).block_size
        except CheckpointError:
            continue
    listed = ", ".join(map(str, folders))
    raise click.ClickException(f"no checkpoint config in {listed} to read the block size from: "
                               "give --block-size")


def generation_configs(block: int) -> tuple[tuple[str, dict[str, Any]], ...]:
    """The generation suite's decodings for a model with blocks of ``block`` tokens."""
    fixed = {"block_size": block}
    return (
        ("static, 1 token/pass", {**fixed, "strategy": "static", "steps_per_block": block}),
        ("static, 2 steps/block", {**fixed, "strategy": "static", "steps_per_block": 2}),
        ("static, 1 step/block", {**fixed, "strategy": "static", "steps_per_block": 1}),
        *((f"dynamic {t:g}", {**fixed, "strategy": "dynamic", "threshold": t, "steps_per_block": block})
          for t in (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)),
    )  # fmt: skip


GENERATION_TOKENS = 48

_console = Console()


def submit_on(cq: Client, body: dict[str, Any], version: str | None) -> Job:
    """Submit ``body``; with ``version``, resubmit until the job is not pinned to another one."""
    for _ in range(REROUTE_TRIES):
        job = cq.submit_job(body)
        if version is None or job.routed_version in (None, version):
            return job
        cq.cancel(job.id)
    raise click.ClickException(f"no job was routed to version {version} in {REROUTE_TRIES} tries")


def run_all(cq: Client, bodies: list[dict[str, Any]], version: str | None, timeout: float) -> list[Job]:
    """Submit every body (asking for ``version``), then wait for each: the finished jobs, whatever
    version ran them."""
    jobs = [submit_on(cq, body, version) for body in bodies]
    return [cq.wait(job.id, timeout=timeout) for job in jobs]


def run_jobs(
    cq: Client, bodies: list[dict[str, Any]], version: str | None, timeout: float
) -> list[Job | None]:
    """:func:`run_all`, with ``None`` for a job that ran on a version other than ``version``."""
    done = run_all(cq, bodies, version, timeout)
    return [job if version is None or job.model_version == version else None for job in done]


def _answers(job: Job | None) -> tuple[list[str] | None, int]:
    if job is None or job.status != "succeeded" or job.result is None or job.result.answers is None:
        return None, 0
    return [str(a["choice"]) for a in job.result.answers], retries(job.result.usage)


def evaluate_decisions(cq: Client, cases: list[DecisionCase], version: str | None, timeout: float,
                       params: dict[str, Any] | None = None,
                       constraints: bool = False) -> dict[str, DecisionTally]:  # fmt: skip
    """Tallies by mode for ``cases`` (each submitted once per mode); ``constraints``: joint jobs
    declare each tied group's rule (``DecisionCase.constraints``)."""
    tallies: dict[str, DecisionTally] = {}
    for mode in MODES:
        bodies = [{"kind": "decide", "input": c.job_input(mode, constraints), "params": dict(params or {})}
                  for c in cases]  # fmt: skip
        tally = DecisionTally()
        for case, job in zip(cases, run_jobs(cq, bodies, version, timeout), strict=True):
            answers, retries = _answers(job)
            tally.add(case, answers, retries)
        tallies[mode] = tally
    return tallies


def evaluate_extraction(
    cq: Client, cases: list[ExtractionCase], version: str | None, timeout: float
) -> ExtractionTally:
    tally = ExtractionTally()
    jobs = run_jobs(cq, [{"kind": "extract", "input": c.job_input()} for c in cases], version, timeout)
    for case, job in zip(cases, jobs, strict=True):
        ok = job is not None and job.status == "succeeded" and job.result is not None
        result = job.result if ok and job is not None else None
        usage = result.usage if result is not None else None
        tally.add(case, result.data if result is not None else None, retries(usage))
    return tally


def _split_table(title: str, tallies: dict[str, Any], rows: tuple[tuple[str, str], ...]) -> Table:
    """A column per split, a row per ``(label, key)`` of the tallies' ``as_dict`` (shares in %, "-"
    for a share of nothing)."""
    table = Table(title=title)
    table.add_column("")
    for split in tallies:
        table.add_column(f"{split} split", justify="right")
    summaries = [t.as_dict() for t in tallies.values()]
    for label, key in rows:
        cells = (_percent(d[key]) if d[key] is None or isinstance(d[key], float) else str(d[key])
                 for d in summaries)  # fmt: skip
        table.add_row(label, *cells)
    return table


def _extraction_table(tallies: dict[str, ExtractionTally]) -> Table:
    rows = (
        ("jobs", "jobs"),
        ("field accuracy", "field_accuracy"),
        ("every field right", "all_fields_correct"),
        ("schema-valid", "schema_valid"),
        ("invalid-output retries", "invalid_output_retries"),
        ("failed jobs", "failed_jobs"),
    )
    return _split_table("extraction (extract jobs)", tallies, rows)


def evaluate_tool_calls(cq: Client, cases: list[ToolCallCase], version: str | None,
                        timeout: float) -> ToolCallTally:  # fmt: skip
    tally = ToolCallTally()
    bodies = [{"kind": "generate", "input": c.job_input(), "params": {"max_new_tokens": TOOL_TOKENS}}
              for c in cases]  # fmt: skip
    for case, job in zip(cases, run_jobs(cq, bodies, version, timeout), strict=True):
        ok = job is not None and job.status == "succeeded" and job.result is not None
        result = job.result if ok and job is not None else None
        tally.add(case, result.text if result is not None else None, result.tool_calls if result else None,
                  retries(result.usage if result else None))
    return tally


def _tool_table(tallies: dict[str, ToolCallTally]) -> Table:
    rows = (
        ("jobs", "jobs"),
        ("all right", "accuracy"),
        ("requests: right function", "right_function"),
        ("requests: right call", "right_call"),
        ("questions: no call", "no_call_when_none_needed"),
        ("questions: right line", "right_answer"),
        ("malformed calls (after the retry)", "malformed_calls"),
        ("invalid-output retries", "invalid_output_retries"),
        ("failed jobs", "failed_jobs"),
    )
    return _split_table("tool calls (generate jobs with tools, tool_choice auto)", tallies, rows)


def generation_body(case: GenerationCase, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": "generate",
        "input": {"messages": list(case.messages)},
        "params": {"max_new_tokens": GENERATION_TOKENS, "thinking": case.thinking, **params},
    }


def evaluate_generation(cq: Client, cases: list[GenerationCase], version: str | None, timeout: float,
                        block: int) -> dict[str, GenerationTally]:  # fmt: skip
    tallies = {}
    for label, params in generation_configs(block):
        tally = GenerationTally()
        jobs = run_jobs(cq, [generation_body(c, params) for c in cases], version, timeout)
        for case, job in zip(cases, jobs, strict=True):
            ok = job is not None and job.status == "succeeded" and job.result is not None
            usage = (job.result.usage or {}) if ok and job and job.result else {}
            text = job.result.text if ok and job and job.result else None
            tally.add(case, text, int(usage.get("completion_tokens", 0)), int(usage.get("steps_used", 0)))
        tallies[label] = tally
    return tallies


def _percent(value: object) -> str:
    return "-" if value is None else f"{100 * float(value):.1f}%"  # type: ignore[arg-type]


def _decision_table(split: str, tallies: dict[str, DecisionTally]) -> Table:
    table = Table(title=f"decisions, {split} split")
    table.add_column("")
    for mode in tallies:
        table.add_column(mode, justify="right")
    rows: Iterable[tuple[str, Callable[[dict[str, Any]], str]]] = (
        ("questions", lambda d: str(d["questions"])),
        ("accuracy", lambda d: _percent(d["accuracy"])),
        ("groups", lambda d: str(d["groups"])),
        ("group all-correct", lambda d: _percent(d["group_all_correct"])),
        ("consistency violations", lambda d: str(d["consistency_violations"])),
        ("invalid-output retries", lambda d: str(d["invalid_output_retries"])),
        ("failed jobs", lambda d: str(d["failed_jobs"])),
    )
    summaries = [t.as_dict() for t in tallies.values()]
    for label, cell in rows:
        table.add_row(label, *(cell(s) for s in summaries))
    return table


@click.command("eval")
@click.option("--suite", type=click.Choice(["decisions", "generation", "extraction", "tools"]), required=True)
@click.option("--seed", type=int, default=EVAL_SEED, show_default=True, help="Seed of the evaluation cases.")
@click.option("--count", type=int, default=None,
              help="Cases per split [decisions: 60, generation: 30, extraction: 60, tools: 60].")  # fmt: skip
@click.option("--version", default=None, help="Count only jobs that ran on this model version.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the JSON report here.")  # fmt: skip
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds to wait per job.")
@click.option("--block-size", type=click.IntRange(min=1), default=None,
              help="generation: the model's block size (the steps of each decoding follow it) "
                   "[default: the served checkpoint's, as its worker reads it].")  # fmt: skip
@click.option("--constraints", is_flag=True,
              help="decisions: joint jobs declare each question group's rule as a constraint.")  # fmt: skip
def eval_command(suite: str, seed: int, count: int | None, version: str | None, report_path: Path | None,
                 timeout: float, block_size: int | None, constraints: bool) -> None:  # fmt: skip
    """Run an evaluation suite as jobs on the running service and print the scores."""
    report: dict[str, Any] = {"suite": suite, "seed": seed, "version": version}
    if suite == "decisions":
        report["constraints"] = constraints
    with api_client() as cq:
        if suite == "decisions":
            splits: tuple[Split, ...] = ("eval", "heldout")
            for split in splits:
                tallies = evaluate_decisions(cq, decision_cases(split, seed, count or 60), version, timeout,
                                             constraints=constraints)
                report[split] = {mode: t.as_dict() for mode, t in tallies.items()}
                _console.print(_decision_table(split, tallies))
        elif suite == "extraction":
            extraction = {
                split: evaluate_extraction(cq, extraction_cases(split, seed, count or 60), version, timeout)
                for split in ("eval", "heldout")
            }
            report |= {split: t.as_dict() for split, t in extraction.items()}
            _console.print(_extraction_table(extraction))
        elif suite == "tools":
            tools = {split: evaluate_tool_calls(cq, tool_call_cases(split, seed, count or 60), version,
                                                timeout)
                     for split in ("eval", "heldout")}  # fmt: skip
            report |= {split: t.as_dict() for split, t in tools.items()}
            _console.print(_tool_table(tools))
        else:
            cases = generation_cases("eval", seed, count or 30)
            block_size = block_size or served_block_size(get_settings())
            gen = evaluate_generation(cq, cases, version, timeout, block_size)
            report["block_size"] = block_size  # what every decoding asked for (the option or the config read)
            report["configs"] = {label: t.as_dict() for label, t in gen.items()}
            table = Table(title=f"generation, eval split, blocks of {block_size} (exact one-line score)")
            for column in ("decoding", "tokens/pass", "score", "failed jobs"):
                table.add_column(column, justify="right" if column != "decoding" else "left")
            for label, t in gen.items():
                d = t.as_dict()
                table.add_row(label, str(d["tokens_per_pass"]), _percent(d["score"]), str(d["failed_jobs"]))
            _console.print(table)
    text = json.dumps(report, indent=2, sort_keys=True)
    if report_path is not None:
        report_path.write_text(text + "\n")
    click.echo(text)


def register(group: click.Group) -> None:
    from cli.model import model_group

    model_group(group).add_command(eval_command)
