"""``cloverq batch submit | status | results | cancel``: cloverq batches (``/v1/batches``) from
the command line, on the Python client (``client/``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from cli.api_client import api_client, echo_json
from cli.json_option import json_option


@click.group("batch")
def batch_group() -> None:
    """Many jobs in one request: submit a JSONL file, follow it, read its results in order."""


@batch_group.command("submit")
@click.argument("jsonl", type=click.Path(exists=True, dir_okay=False, allow_dash=True, path_type=Path))
@click.option("--webhook-url", help="POSTed (signed) once every job is final.")
@click.option("--metadata", "metadata_json", help="Batch metadata as a JSON object.")
@click.option("--wait", is_flag=True, help="Wait until every job is final, then print the batch.")
@click.option("--timeout", type=float, help="--wait: give up after this many seconds (the batch goes on).")
def submit(jsonl: Path, webhook_url: str | None, metadata_json: str | None, wait: bool,
           timeout: float | None) -> None:
    """Submit JSONL (one ``POST /v1/jobs`` body per line; '-' reads stdin) as one batch."""
    content = sys.stdin.buffer.read() if str(jsonl) == "-" else jsonl.read_bytes()
    with api_client() as cq:
        if metadata_json is None:
            batch = cq.upload_batch(content, webhook_url=webhook_url)
        else:  # metadata travels in the JSON form of the request
            jobs = [json_option(line, f"{jsonl}, line {number}", dict, "(one job's body)", one_line=True)
                    for number, line in enumerate(content.decode().splitlines(), start=1) if line.strip()]
            metadata = json_option(metadata_json, "--metadata", dict)
            batch = cq.create_batch(jobs, webhook_url=webhook_url, metadata=metadata)
        if wait:
            batch = cq.wait_batch(batch.id, timeout=timeout)
    echo_json(batch)


@batch_group.command("status")
@click.argument("batch_id")
def status(batch_id: str) -> None:
    """The batch and its job counts by status."""
    with api_client() as cq:
        echo_json(cq.get_batch(batch_id))


@batch_group.command("results")
@click.argument("batch_id")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the JSONL here instead of stdout.")
def results(batch_id: str, output: Path | None) -> None:
    """The results as JSONL, one line per job in submission order (unfinished jobs: their status)."""
    with api_client() as cq:
        lines: list[dict[str, Any]] = list(cq.batch_results(batch_id))
    text = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines)
    if output is None:
        click.echo(text, nl=False)
    else:
        output.write_text(text)
        click.echo(f"{len(lines)} results written to {output}", err=True)


@batch_group.command("cancel")
@click.argument("batch_id")
def cancel(batch_id: str) -> None:
    """Cancel every queued job at once and signal the running ones."""
    with api_client() as cq:
        echo_json(cq.cancel_batch(batch_id))


def register(group: click.Group) -> None:
    """Add ``batch`` to the ``cloverq`` group."""
    group.add_command(batch_group)
