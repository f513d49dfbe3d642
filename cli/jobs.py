"""Client commands over the HTTP API: ``submit [--wait]``, ``jobs`` (a table), ``cancel``.

They talk to ``CLOVERQ_API_URL`` (default http://127.0.0.1:8000) with ``CLOVERQ_API_KEY`` or,
for the embedded default, the dev key ``cloverq up`` left in ``data_dir/dev_api_key``. They are
plain HTTP clients: anything they do, curl can do too.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click
import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from scheduler.settings import Settings, get_settings

DEV_KEY_FILE = "dev_api_key"  # written by `cloverq up` (scheduler.keys.ensure_dev_key)
FINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled", "expired"})

_console = Console(stderr=True)


def register(group: click.Group) -> None:
    """Add the client commands to the ``cloverq`` group."""
    for command in (submit, jobs, cancel):
        group.add_command(command)


def _api_key(settings: Settings) -> str | None:
    if settings.api_key:
        return settings.api_key
    path = settings.data_dir / DEV_KEY_FILE
    return path.read_text().strip() if path.is_file() else None


@contextmanager
def _client() -> Iterator[httpx.Client]:
    settings = get_settings()
    key = _api_key(settings)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=settings.api_url, headers=headers, timeout=30.0) as client:
        try:
            yield client
        except httpx.TransportError as exc:  # the API is not there: say where we looked
            raise click.ClickException(
                f"cannot reach the cloverq API at {settings.api_url} ({exc}); "
                "is it running? set CLOVERQ_API_URL to point elsewhere"
            ) from None


def _checked(response: httpx.Response) -> dict[str, Any]:
    """The JSON body, or a clean CLI error carrying the API's error code and message."""
    try:
        body = response.json()
    except ValueError:
        raise click.ClickException(f"HTTP {response.status_code}: {response.text[:200]}") from None
    if response.status_code >= 400:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        details = error.get("details")
        suffix = f"\n{json.dumps(details, indent=2)}" if details else ""
        raise click.ClickException(
            f"{error.get('code', 'error')} (HTTP {response.status_code}): {error.get('message', '')}{suffix}"
        )
    if not isinstance(body, dict):
        raise click.ClickException(f"unexpected response: {body!r}")
    return body


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
@click.option("--priority", type=click.Choice(["interactive", "standard", "bulk"]))
@click.option("--idempotency-key")
@click.option("--wait", is_flag=True, help="Wait for the job, showing a progress bar of blocks and steps.")
@click.option("--poll-interval", type=float, default=0.25, show_default=True)
def submit(
    prompt: str | None, messages_json: str | None, idempotency_key: str | None, wait: bool,
    poll_interval: float, priority: str | None, **params: Any,
) -> None:
    """Submit a generation job (PROMPT, or --messages, or the prompt on stdin with '-')."""
    if prompt == "-":
        prompt = sys.stdin.read()
    if (prompt is None) == (messages_json is None):
        raise click.UsageError("give exactly one of PROMPT or --messages")
    job_input: dict[str, Any] = (
        {"prompt": prompt} if prompt is not None else {"messages": json.loads(messages_json or "[]")}
    )
    body: dict[str, Any] = {
        "kind": "generate",
        "input": job_input,
        "params": {name: value for name, value in params.items() if value is not None},
    }
    if priority:
        body["priority"] = priority
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    with _client() as client:
        job = _checked(client.post("/v1/jobs", json=body, headers=headers))
        if not wait:
            click.echo(json.dumps(job, indent=2))
            return
        job = _wait_with_progress(client, job, poll_interval)
    click.echo(json.dumps(job, indent=2))
    if job["status"] != "succeeded":
        sys.exit(1)


def _wait_with_progress(client: httpx.Client, job: dict[str, Any], poll_interval: float) -> dict[str, Any]:
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=_console, transient=False) as bar:
        blocks = bar.add_task("blocks", total=None, detail="")
        steps = bar.add_task("steps", total=None, detail="")
        while job["status"] not in FINAL_STATUSES:
            time.sleep(poll_interval)
            job = _checked(client.get(f"/v1/jobs/{job['id']}"))
            progress = job.get("progress") or {}
            bar.update(blocks, completed=progress.get("blocks_done") or 0,
                       total=progress.get("blocks_total"), detail=job["status"])
            bar.update(steps, completed=progress.get("steps_used") or 0,
                       total=progress.get("step_budget"),
                       detail=f"{progress.get('tokens_committed') or 0} tokens")
        final = job.get("progress") or {}
        for task, key in ((blocks, "blocks_done"), (steps, "steps_used")):  # finished: bars end full
            done = final.get(key) or 0
            bar.update(task, total=done or None, completed=done)
    return job


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
    query = {k: v for k, v in {"status": status, "kind": kind, "queue": queue, "limit": limit,
                               "cursor": cursor}.items() if v is not None}
    with _client() as client:
        page = _checked(client.get("/v1/jobs", params=query))
    if as_json:
        click.echo(json.dumps(page, indent=2))
        return
    table = Table("id", "kind", "status", "queue", "attempt", "steps", "finish", "created")
    for item in page["items"]:
        progress = item.get("progress") or {}
        result = item.get("result") or {}
        table.add_row(
            item["id"], item["kind"], item["status"], item.get("queue") or "",
            str(item.get("attempt", "")), str(progress.get("steps_used") or ""),
            result.get("finish_reason") or "", (item["timings"].get("created_at") or "")[:19],
        )
    console = Console()
    console.width = max(console.width, 160)  # full ids even when piped
    console.print(table)
    if page.get("next_cursor"):
        click.echo(f"next page: cloverq jobs --cursor {page['next_cursor']}")


@click.command()
@click.argument("job_id")
def cancel(job_id: str) -> None:
    """Cancel a job (queued: at once; running: within one denoising pass)."""
    with _client() as client:
        job = _checked(client.post(f"/v1/jobs/{job_id}/cancel"))
    click.echo(json.dumps(job, indent=2))
