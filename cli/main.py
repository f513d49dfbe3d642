"""The ``cloverq`` command line: one click group; each concern adds its commands in its own module.

This package is the composition root: it is the only place that imports ``api``, ``worker`` and
``scheduler`` together (the layering ``api -> scheduler <- worker`` holds below it).
"""

from __future__ import annotations

import importlib
import sys

import click
from pydantic import ValidationError
from pydantic_settings import SettingsError

from scheduler.infra.settings import CONFIG_ERROR_EXIT_CODE, settings_error_lines

# Modules that each define ``register(group: click.Group) -> None``.
COMMAND_MODULES: tuple[str, ...] = (
    "cli.model",  # model init-demo / verify / plan
    "cli.model_store",  # model pull / list (adds to the model group)
    "cli.model_versions",  # model activate / rollback / versions (adds to the model group)
    "cli.model_canary",  # model canary / promote / abort (adds to the model group)
    "cli.model_train",  # model train-demo (adds to the model group)
    "cli.model_eval",  # model eval --suite decisions|generation (adds to the model group)
    "cli.model_golden",  # model golden record / check (adds to the model group)
    "cli.generate",  # offline generation through the engine
    "cli.services",  # up / api / worker / beat / migrate
    "cli.jobs",  # submit / decide / jobs / cancel
    "cli.extract",  # extract (a JSON Schema's value from a document)
    "cli.batch",  # batch submit / status / results / cancel
    "cli.keys",  # keys create / list / revoke
    "cli.tenants",  # tenants weight / weights (fair share)
    "cli.top",  # live terminal view
    "cli.probe",  # probe worker [--ready]: exec probes for containers (deploy/)
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--url", default=None, metavar="URL",
              help="The API the client commands (submit, jobs, decide, batch, ...) talk to "
                   "(default: CLOVERQ_API_URL, else the stack `cloverq up` recorded).")
@click.option("--key", default=None, metavar="KEY",
              help="Their API key (default: CLOVERQ_API_KEY, else the dev key of `cloverq up`).")
def cli(url: str | None, key: str | None) -> None:
    """cloverq: an asynchronous job system for MoE block-diffusion language models.

    --url and --key go before the command: cloverq --url URL jobs."""
    # the client commands read them from the root context (cli.api_client.resolve_target)


def _register_all() -> None:
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that command group is not part of this build
                continue
            raise
        module.register(cli)


_register_all()


def main() -> None:
    """Console-script entry point. An invalid setting (a ``CLOVERQ_*`` variable, or the file a
    ``*_FILE`` variable names, that the settings refuse) ends any command with one line per
    variable and exit status 78 (EX_CONFIG, as a refused TLS file), not a traceback."""
    try:
        cli()
    except ValidationError as exc:
        lines = settings_error_lines(exc)
        if lines is None:
            raise
        _refuse_configuration(lines)
    except SettingsError as exc:  # the environment source's own refusals (settings_env.py)
        _refuse_configuration([str(exc)])


def _refuse_configuration(lines: list[str]) -> None:
    click.echo("cloverq: invalid configuration:\n" + "\n".join(f"  {line}" for line in lines), err=True)
    sys.exit(CONFIG_ERROR_EXIT_CODE)
