"""``cloverq extract``: a value valid against a JSON Schema, read from a document, on the Python
client (``client/``). The document and the schema come from options or files ('-': stdin), so it
fits a shell pipeline: ``pdftotext contract.pdf - | cloverq extract --context-file - --schema-file
fields.json --wait --data``.
"""

from __future__ import annotations

import json
import sys
from typing import IO, Any

import click

from cli.api_client import api_client, echo_json
from cli.jobs import _finish, _params, template_job_options
from cli.json_option import json_option
from scheduler.jobs.models import JobStatus


def register(group: click.Group) -> None:
    """Add ``extract`` to the ``cloverq`` group."""
    group.add_command(extract)


def _one(value: str | None, file: IO[str] | None, what: str) -> str:
    """The text of ``--WHAT`` or ``--WHAT-file`` (exactly one of them)."""
    if (value is None) == (file is None):
        raise click.UsageError(f"give exactly one of --{what} or --{what}-file")
    return value if value is not None else file.read()  # type: ignore[union-attr]


def _schema(text: str, source: str) -> dict[str, Any]:
    """The schema as a JSON object, or a usage error that says where the JSON breaks."""
    schema: dict[str, Any] = json_option(text, source, dict, "(a JSON Schema)")
    return schema


@click.command()
@click.option("--context", help="The document (or --context-file).")
@click.option("--context-file", type=click.File("r"), help="Read the document from a file ('-': stdin).")
@click.option("--schema", "schema_json",
              help="The JSON Schema of the value to extract, as JSON (or --schema-file).")
@click.option("--schema-file", type=click.File("r"), help="Read the JSON Schema from a file ('-': stdin).")
@click.option("--instructions", help="What to look for, in words (after the document in the prompt).")
@template_job_options
@click.option("--wait", is_flag=True, help="Wait for the value and print the job.")
@click.option("--data", "data_only", is_flag=True,
              help="With --wait: print only the value (result.data) as JSON; exit 1 if the job failed.")
def extract(context: str | None, context_file: IO[str] | None, schema_json: str | None,
            schema_file: IO[str] | None, instructions: str | None, priority: str | None,
            idempotency_key: str | None, wait: bool, data_only: bool, **params: Any) -> None:
    """Submit an extract job: a value valid against a JSON Schema, read from a document.

    The result's data validates against the schema by construction; its confidence gives each
    choice field's probability."""
    if context_file is not None and schema_file is not None and \
            context_file.name == schema_file.name == "<stdin>":
        raise click.UsageError("--context-file and --schema-file cannot both read stdin ('-')")
    if data_only and not wait:
        raise click.UsageError("--data needs --wait (the value exists once the job succeeded)")
    text = _one(context, context_file, "context")
    source = "--schema" if schema_file is None else f"--schema-file {schema_file.name}"
    schema = _schema(_one(schema_json, schema_file, "schema"), source)
    with api_client() as cq:
        job = cq.extract(text, schema, instructions=instructions, params=_params(params), priority=priority,
                         idempotency_key=idempotency_key)
        if not wait:
            echo_json(job)
            return
        job = cq.wait(job.id)
    if not data_only:
        _finish(job)
        return
    if job.status != JobStatus.SUCCEEDED:
        click.echo(json.dumps(job.model_dump(mode="json"), indent=2), err=True)
        sys.exit(1)
    click.echo(json.dumps(job.data, ensure_ascii=False))
