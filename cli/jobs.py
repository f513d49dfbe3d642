"""Client commands over the HTTP API: ``submit [--wait | --stream]``, ``decide``, ``jobs`` (a
table), ``cancel``. Built on the Python client (``client/``, through ``cli/api_client.py``);
anything they do, curl can do too.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from cli.api_client import api_client, echo_json
from cli.json_option import json_option
from client import Client, CloverqError, Job, JobEvent, JobProgress
from scheduler.access.dev_key import DEV_KEY_FILE
from scheduler.infra.queue_names import PRIORITY_CLASSES
from scheduler.jobs.models import JobStatus

PRIORITY_CHOICES = [q.value for q in PRIORITY_CLASSES]  # the classes a client may ask for

__all__ = ["DEV_KEY_FILE", "register"]

_console = Console(stderr=True)


def register(group: click.Group) -> None:
    """Add the client commands to the ``cloverq`` group."""
    for command in (submit, decide, jobs, cancel):
        group.add_command(command)


def _params(values: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in values.items() if value is not None}


F = TypeVar("F", bound=Callable[..., Any])


def template_job_options(command: F) -> F:
    """The options of the jobs whose output is a template the model fills (decide, extract): the
    decoding knobs that apply to them, the priority and the idempotency key."""
    for option in reversed((
        click.option("--block-size", type=int),
        click.option("--steps-per-block", type=int),
        click.option("--temperature", type=float),
        click.option("--seed", type=int),
        click.option("--step-budget", type=int),
        click.option("--priority", type=click.Choice(PRIORITY_CHOICES)),
        click.option("--idempotency-key"),
    )):
        command = option(command)
    return command


def _finish(job: Job) -> None:
    echo_json(job)
    if job.status != JobStatus.SUCCEEDED:
        sys.exit(1)


@click.command()
@click.argument("prompt", required=False)
@click.option("--messages", "messages_json", help="Chat messages as a JSON list of {role, content}.")
@click.option("--max-new-tokens", type=int)
@click.option("--block-size", type=int)
@click.option("--steps-per-block", type=int)
@click.option("--strategy", type=click.Choice(["static", "dynamic"]))
@click.option("--threshold", type=float)
@click.option("--temperature", type=float)
@click.option("--top-p", type=float)
@click.option("--top-k", type=int)
@click.option("--seed", type=int)
@click.option("--step-budget", type=int)
@click.option("--thinking/--no-thinking", default=None)
@click.option("--priority", type=click.Choice(PRIORITY_CHOICES))
@click.option("--idempotency-key")
@click.option("--wait", is_flag=True,
              help="Wait for the job, showing progress bars of the prompt's prefill, then blocks, and steps.")
@click.option("--stream", "stream_text", is_flag=True,
              help="Print the text as each block is committed (stdout), then the job (stderr).")
@click.option("--poll-interval", type=float, default=0.25, show_default=True,
              help="--wait: seconds between polls while a prompt prefills (the event stream reports "
              "blocks only) or when the server has no event stream.")
def submit(
    prompt: str | None, messages_json: str | None, idempotency_key: str | None, wait: bool, stream_text: bool,
    poll_interval: float, priority: str | None, **params: Any,
) -> None:
    """Submit a generation job (PROMPT, or --messages, or the prompt on stdin with '-')."""
    if prompt == "-":
        prompt = sys.stdin.read()
    if (prompt is None) == (messages_json is None):
        raise click.UsageError("give exactly one of PROMPT or --messages")
    messages = (json_option(messages_json, "--messages", list, "of {role, content}")
                if messages_json is not None else None)
    with api_client() as cq:
        job = cq.submit(prompt, messages=messages, params=_params(params), priority=priority,
                        idempotency_key=idempotency_key)
        if stream_text:
            for piece in cq.stream_text(job.id):
                click.echo(piece, nl=False)
            click.echo()
            job = cq.wait(job.id)
            click.echo(json.dumps(job.model_dump(mode="json"), indent=2), err=True)
            if job.status != JobStatus.SUCCEEDED:
                sys.exit(1)
            return
        if not wait:
            echo_json(job)
            return
        job = _wait_with_progress(cq, job, poll_interval)
    _finish(job)


def _bars() -> Progress:
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
    )
    return Progress(*columns, console=_console, transient=False)


def _show(bar: Progress, blocks: TaskID, steps: TaskID, progress: dict[str, Any], status: str) -> None:
    """The bars for one progress report: ``prefill N/M tokens`` while the prompt is prefilled
    (``prompt_tokens_done`` < ``prompt_tokens``, no block yet), then ``blocks N/M``."""
    if JobProgress.model_validate(progress).prefilling:
        bar.update(blocks, description="prefill", completed=progress.get("prompt_tokens_done") or 0,
                   total=progress.get("prompt_tokens"), detail=f"tokens {status}")
    else:
        bar.update(blocks, description="blocks", completed=progress.get("blocks_done") or 0,
                   total=progress.get("blocks_total"), detail=status)
    bar.update(steps, completed=progress.get("steps_used") or 0, total=progress.get("step_budget"),
               detail=f"{progress.get('tokens_committed') or 0} tokens")


def _poll_prefill(cq: Client, job: Job, poll_interval: float,
                  show: Callable[[dict[str, Any], str], None]) -> Job:
    """Poll ``GET /v1/jobs/{id}`` while the running job has committed no block: the event stream
    reports progress per committed block only, so a long prompt's prefill shows nothing there."""
    while True:
        job = cq.get(job.id)
        progress = job.progress or JobProgress()
        show(progress.model_dump(), job.status)
        if job.is_final or job.status != JobStatus.RUNNING or progress.blocks_done:
            return job
        time.sleep(poll_interval)


@contextmanager
def _closing(events: Iterator[JobEvent]) -> Iterator[Iterator[JobEvent]]:
    """``events``, closed on leaving (left early, the stream's connection ends at once)."""
    try:
        yield events
    finally:
        if isinstance(events, Generator):
            events.close()


def _wait_with_progress(cq: Client, job: Job, poll_interval: float) -> Job:
    """Follow the job's event stream (progress per committed block) until its result. Once it
    runs, poll ``GET /v1/jobs/{id}`` until its first block (the prefill's ``prompt_tokens_done``
    of ``prompt_tokens``) and then follow the stream again; poll instead when the stream is not
    available."""
    with _bars() as bar:
        blocks = bar.add_task("blocks", total=None, detail="")
        steps = bar.add_task("steps", total=None, detail="")

        def show(progress: dict[str, Any], status: str) -> None:
            _show(bar, blocks, steps, progress, status)

        status = job.status
        prefill_polled = False
        try:
            while not job.is_final:
                with _closing(cq.stream(job.id)) as events:  # from the start again after the prefill
                    for event in events:
                        if event.event == "status":
                            status = str(event.data.get("status"))
                            if status == JobStatus.RUNNING and not prefill_polled:
                                break  # nothing on the stream until the first block: poll the prefill
                        elif event.event == "progress":
                            prefill_polled = True  # a block is committed: the prefill is over
                            show(event.data, status)
                        elif event.event == "result" and event.job is not None:
                            job = event.job
                    else:
                        break  # the stream ended (after its result)
                prefill_polled = True
                job = _poll_prefill(cq, job, poll_interval, show)
        except CloverqError as exc:
            if exc.status != 404 or exc.code == "job_not_found":
                raise
        while not job.is_final:  # no event stream here: poll
            time.sleep(poll_interval)
            job = cq.get(job.id)
            _show(bar, blocks, steps, job.progress.model_dump() if job.progress else {}, job.status)
        final = job.progress.model_dump() if job.progress else {}
        for task, key in ((blocks, "blocks_done"), (steps, "steps_used")):  # finished: bars end full
            done = final.get(key) or 0
            bar.update(task, total=done or None, completed=done)
        bar.update(blocks, description="blocks")
    return job


def _constraints(constraints_json: str | None) -> list[dict[str, Any]] | None:
    if not constraints_json:
        return None
    shape = 'of {"questions", "allowed"}'
    raw: list[dict[str, Any]] = json_option(constraints_json, "--constraints", list, shape, files=True)
    return raw


def _questions(questions_json: str | None, question: tuple[str, ...],
               choices: str | None) -> list[dict[str, Any]]:
    parsed: list[dict[str, Any]] = []
    if questions_json:
        parsed.extend(json_option(questions_json, "--questions", list, "of {id, text, choices?}", files=True))
    for index, item in enumerate(question, start=len(parsed) + 1):
        qid, sep, text = item.partition("=")
        if not sep:
            qid, text = f"q{index}", item
        entry: dict[str, Any] = {"id": qid.strip(), "text": text.strip()}
        if choices:
            entry["choices"] = [c.strip() for c in choices.split(",") if c.strip()]
        parsed.append(entry)
    if not parsed:
        raise click.UsageError("give at least one --question or --questions")
    return parsed


@click.command()
@click.option("--context", help="The document to judge (or --context-file).")
@click.option("--context-file", type=click.File("r"), help="Read the document from a file ('-': stdin).")
@click.option("--question", "question", multiple=True,
              help="A question, 'ID=TEXT' or just TEXT (repeat it); choices: --choices, default yes,no.")
@click.option("--choices", help="Comma-separated choices of every --question (default: yes,no).")
@click.option("--questions", "questions_json",
              help='Questions as JSON: [{"id", "text", "choices"}] (or @FILE).')
@click.option("--mode", type=click.Choice(["independent", "joint"]), default="independent", show_default=True)
@click.option("--rationale", is_flag=True, help="A short free-text rationale with every answer.")
@click.option("--constraints", "constraints_json",
              help='Joint mode: answers that must agree, as JSON [{"questions": [ids], "allowed": '
                   '[[choice, ...]]}] (or @FILE).')
@template_job_options
@click.option("--wait", is_flag=True, help="Wait for the answers and print the job.")
def decide(context: str | None, context_file: Any, question: tuple[str, ...], choices: str | None,
           questions_json: str | None, mode: str, rationale: bool, constraints_json: str | None,
           priority: str | None, idempotency_key: str | None, wait: bool, **params: Any) -> None:
    """Submit a decision job: multiple-choice answers about a document, always valid JSON."""
    if (context is None) == (context_file is None):
        raise click.UsageError("give exactly one of --context or --context-file")
    text = context if context is not None else context_file.read()
    if constraints_json and mode != "joint":
        raise click.UsageError("--constraints needs --mode joint (an independent question sees no other)")
    with api_client() as cq:
        job = cq.decide(text, _questions(questions_json, question, choices), mode=mode, rationale=rationale,
                        params=_params(params), priority=priority, idempotency_key=idempotency_key,
                        constraints=_constraints(constraints_json))
        if not wait:
            echo_json(job)
            return
        job = cq.wait(job.id)
    _finish(job)


@click.command()
@click.option("--status")
@click.option("--kind")
@click.option("--queue")
@click.option("--limit", type=int, default=20, show_default=True)
@click.option("--cursor")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON page.")
def jobs(status: str | None, kind: str | None, queue: str | None, limit: int, cursor: str | None,
         as_json: bool) -> None:
    """List jobs, newest first (a table; --json for the raw page)."""
    with api_client() as cq:
        page = cq.list_jobs(status=status, kind=kind, queue=queue, limit=limit, cursor=cursor)
    if as_json:
        echo_json(page)
        return
    table = Table("id", "kind", "status", "queue", "attempt", "steps", "finish", "created")
    for item in page.items:
        created = item.timings.created_at.isoformat()[:19] if item.timings.created_at else ""
        table.add_row(
            item.id, item.kind, item.status, item.queue or "", str(item.attempt),
            str((item.progress.steps_used if item.progress else None) or ""),
            (item.result.finish_reason if item.result else None) or "", created,
        )
    console = Console()
    console.width = max(console.width, 160)  # full ids even when piped
    console.print(table)
    if page.next_cursor:
        click.echo(f"next page: cloverq jobs --cursor {page.next_cursor}")


@click.command()
@click.argument("job_id")
def cancel(job_id: str) -> None:
    """Cancel a job (queued: at once; running: within one denoising pass)."""
    with api_client() as cq:
        echo_json(cq.cancel(job_id))
