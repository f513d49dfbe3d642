"""``cloverq model golden record|check``: fixed inputs, expected outputs, checked through jobs.

``record`` runs the golden inputs (``worker.training.golden.golden_inputs``) on the running
service and writes their outputs as the expected ones (run it on a version known to be good:
the shipped file was recorded from the trained demo). ``check`` runs a golden file's cases
against a version (``--version``: only jobs that ran on it count; a canary's version is reached
by resubmitting what the canary routed elsewhere), lists the differences, records pass/fail for
the version (``scheduler.model_versions.golden``, what ``promote --require-golden`` reads) and exits 1 on a
failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from cli.api_client import api_client
from cli.model import model_group
from cli.model_eval import run_all, run_jobs
from cli.stack_record import stack_settings
from client import Job
from worker.training.golden import GOLDEN_FILE, differences, golden_inputs, load_golden, record, write_golden


def _result(job: Job | None) -> dict[str, Any] | None:
    if job is None or job.status != "succeeded" or job.result is None:
        return None
    return job.result.model_dump()


@click.group("golden")
def golden_group() -> None:
    """Golden sets: record expected outputs from a good version, check a version against them."""


@golden_group.command("record")
@click.option("--file", "path", type=click.Path(dir_okay=False, path_type=Path), default=GOLDEN_FILE,
              show_default=True)  # fmt: skip
@click.option("--version", default=None, help="Record from jobs that ran on this version.")
@click.option("--timeout", type=float, default=600.0, show_default=True)
def record_command(path: Path, version: str | None, timeout: float) -> None:
    """Run the golden inputs and write what came back as the expected outputs."""
    cases = golden_inputs()
    with api_client() as cq:
        jobs = run_jobs(cq, [c["body"] for c in cases], version, timeout)
    missing = [c["id"] for c, j in zip(cases, jobs, strict=True) if _result(j) is None]
    if missing:
        raise click.ClickException(f"{len(missing)} golden jobs did not succeed: {', '.join(missing)}")
    write_golden(path, [record(c, _result(j) or {}) for c, j in zip(cases, jobs, strict=True)])
    click.echo(f"recorded {len(cases)} golden cases into {path}")


@golden_group.command("check")
@click.option("--file", "path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=GOLDEN_FILE, show_default=True)  # fmt: skip
@click.option("--version", default=None, help="Check this version (only jobs that ran on it count).")
@click.option("--model", "name", default=None,
              help="Record the result for this store model [default: CLOVERQ_SERVED_MODEL].")  # fmt: skip
@click.option("--timeout", type=float, default=600.0, show_default=True)
def check_command(path: Path, version: str | None, name: str | None, timeout: float) -> None:
    """Run a golden file's cases against a version and list the differences (exit 1 if any)."""
    cases, digest = load_golden(path)
    with api_client() as cq:
        jobs = run_all(cq, [c["body"] for c in cases], version, timeout)
    failures = 0
    for case, job in zip(cases, jobs, strict=True):
        # a version no worker serves: the job ran on what is served, and says so
        elsewhere = version is not None and job.model_version != version
        problems = [f"the job ran on {job.model_version or 'no version'}, not {version}"] if elsewhere \
            else differences(case, _result(job))
        failures += bool(problems)
        for problem in problems:
            click.echo(f"DIFF {case['id']}: {problem}")
    ran_on = {j.model_version for j in jobs}  # shown only when no version was asked for
    click.echo(f"golden check: {len(cases) - failures}/{len(cases)} cases pass "
               f"(version {version or ', '.join(sorted(str(v) for v in ran_on))})")  # fmt: skip
    settings = stack_settings()
    name = name or settings.model.served
    if version is not None and name is not None:
        from cli.model_versions import _sessions
        from scheduler.model_versions.golden import record_golden_result

        with _sessions(settings)() as session:
            record_golden_result(session, name=name, version=version, passed=failures == 0, cases=len(cases),
                                 failures=failures, golden_digest=digest)  # fmt: skip
        click.echo(f"recorded for {name} {version}: {'passed' if failures == 0 else 'FAILED'}")
    if failures:
        raise SystemExit(1)


def register(group: click.Group) -> None:
    model_group(group).add_command(golden_group)
