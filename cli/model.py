"""``cloverq model ...``: write the demo checkpoint, verify a checkpoint folder, plan a deployment."""

from __future__ import annotations

import sys
from pathlib import Path

import click


def _model_group(group: click.Group) -> click.Group:
    """The ``model`` group, created here or reused if another module registered it first."""
    existing = group.commands.get("model")
    if isinstance(existing, click.Group):
        return existing

    @group.group("model")
    def model() -> None:
        """Checkpoints: demo, verification, capacity planning."""

    return model


@click.command("init-demo")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--size", type=click.Choice(["tiny", "small"]), default="tiny", show_default=True)
def init_demo(directory: Path, seed: int, size: str) -> None:
    """Write a deterministic demo checkpoint (random weights) into DIRECTORY."""
    from worker.model.demo import write_demo_checkpoint

    folder = write_demo_checkpoint(directory, seed=seed, size=size)  # type: ignore[arg-type]
    click.echo(f"wrote {size} demo checkpoint (seed {seed}) to {folder}")


@click.command("verify")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
def verify(directory: Path) -> None:
    """Check DIRECTORY against its manifest.json; exit 1 naming every bad or missing file."""
    from worker.model.manifest import check_manifest

    problems = check_manifest(directory)
    if problems:
        for problem in problems:
            click.echo(f"BAD  {problem}", err=True)
        sys.exit(1)
    click.echo(f"OK   {directory}")


def register(group: click.Group) -> None:
    """Add the ``model`` group (init-demo, verify, plan) to the root CLI."""
    model = _model_group(group)
    model.add_command(init_demo)
    model.add_command(verify)
