"""``cloverq model pull`` and ``cloverq model list``: the operator's side of the model store.

They attach to the ``model`` group that ``cli.model`` creates (init-demo / verify / plan), so an
operator finds every checkpoint command in one place. The store itself lives in
``worker.model_store``; this module only parses arguments and prints.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from cli.model import model_group
from scheduler.settings import get_settings
from worker import model_store


def _root_option(func: click.decorators.FC) -> click.decorators.FC:
    return click.option(
        "--root",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Store root (default: CLOVERQ_MODEL_ROOT, else <data_dir>/model-store).",
    )(func)


def _resolve_root(root: Path | None) -> Path:
    return root if root is not None else get_settings().resolved_model_root


@click.command("pull")
@click.argument("src")
@click.option("--name", required=True, help="Model name (a folder under the store root).")
@click.option("--version", "version", required=True, help="Version label (immutable once pulled).")
@_root_option
@click.option("--timeout", type=float, default=60.0, show_default=True, help="HTTP timeout, seconds.")
def pull_command(src: str, name: str, version: str, root: Path | None, timeout: float) -> None:
    """Copy SRC (folder, file:// or http(s):// URL) into the store, verify it, publish it.

    The version becomes visible only after every file matched the manifest; any failure
    leaves nothing behind.
    """
    store_root = _resolve_root(root)
    console = Console(stderr=True)
    done_files: set[str] = set()

    def on_progress(relpath: str, _nbytes: int) -> None:
        if relpath not in done_files:
            done_files.add(relpath)
            console.print(f"  fetching {relpath}", highlight=False)

    try:
        pulled = model_store.pull(
            src, name=name, version=version, root=store_root, timeout=timeout, on_progress=on_progress
        )
    except model_store.VerificationError as exc:
        for problem in exc.problems:
            click.echo(f"bad: {problem}", err=True)
        raise click.ClickException(f"{name}/{version} refused: the files do not match the manifest") from exc
    except model_store.ModelStoreError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(
        f"pulled {pulled.name}/{pulled.version}: {pulled.files} files, "
        f"{pulled.size_bytes / 1e6:.1f} MB at {pulled.path}"
    )


@click.command("list")
@_root_option
@click.option("--name", default=None, help="Only this model.")
@click.option("--json", "as_json", is_flag=True, help="One JSON array on stdout.")
def list_command(root: Path | None, name: str | None, as_json: bool) -> None:
    """List the complete, verified versions in the store."""
    store_root = _resolve_root(root)
    try:
        versions = model_store.list_versions(store_root, name=name)
    except model_store.ModelStoreError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(
            json.dumps(
                [
                    {
                        "name": v.name,
                        "version": v.version,
                        "path": str(v.path),
                        "files": v.files,
                        "size_bytes": v.size_bytes,
                    }
                    for v in versions
                ]
            )
        )
        return
    if not versions:
        click.echo(f"no model versions under {store_root}")
        return
    table = Table("name", "version", "files", "size", "path")
    for v in versions:
        table.add_row(v.name, v.version, str(v.files), f"{v.size_bytes / 1e6:.1f} MB", str(v.path))
    Console().print(table)


def register(group: click.Group) -> None:
    """Add ``pull`` and ``list`` to the ``model`` group ."""
    model = model_group(group)
    model.add_command(pull_command)
    model.add_command(list_command)
