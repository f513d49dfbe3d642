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

from cli.model import ByteProgress, model_group
from cli.stack_record import stack_settings
from worker import model_store


def _root_option(func: click.decorators.FC) -> click.decorators.FC:
    return click.option(
        "--root",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Store root (default: CLOVERQ_MODEL_ROOT, else <data_dir>/model-store).",
    )(func)


def _resolve_root(root: Path | None) -> Path:
    return root if root is not None else stack_settings().resolved_model_root


@click.command("pull")
@click.argument("src")
@click.option("--name", required=True, help="Model name (a folder under the store root).")
@click.option("--version", "version", required=True, help="Version label (immutable once pulled).")
@_root_option
@click.option("--timeout", type=float, default=60.0, show_default=True, help="HTTP timeout, seconds.")
@click.option(
    "--link", "link", flag_value="link", help="Hard-link the source files (same filesystem, no copy).",
)
@click.option("--copy", "link", flag_value="copy", help="Copy every byte (also for a hub cache snapshot).")
@click.option(
    "--auto", "link", flag_value="auto", default=True,
    help="[default] Link a Hugging Face cache snapshot on the store's filesystem, copy anything else.",
)
@click.option("--no-config-check", is_flag=True, help="Pull even if this cloverq cannot serve config.json.")
def pull_command(src: str, name: str, version: str, root: Path | None, timeout: float, link: str,
                 no_config_check: bool) -> None:
    """Copy SRC into the store, hash it once, write its manifest, publish it.

    SRC: a folder (a plain Hugging Face download, with or without manifest.json), a Hugging Face
    cache entry (models--org--name or its snapshots/<rev>), a file:// URL, or an http(s):// URL
    of a folder with a manifest.json. When SRC has a manifest every file must match it. The
    version becomes visible only when complete; any failure leaves nothing behind.
    """
    store_root = _resolve_root(root)
    progress = ByteProgress("pulling")
    try:
        pulled = model_store.pull(
            src, name=name, version=version, root=store_root, timeout=timeout, on_progress=progress,
            on_plan=progress.plan, link=link, check_config=not no_config_check,  # type: ignore[arg-type]
        )
    except model_store.VerificationError as exc:
        progress.finish()
        for problem in exc.problems:
            click.echo(f"bad: {problem}", err=True)
        raise click.ClickException(f"{name}/{version} refused: the files do not match the manifest") from None
    except model_store.ModelStoreError as exc:
        raise click.ClickException(" ".join(str(exc).split())) from None
    except OSError as exc:
        raise click.ClickException(f"{name}/{version} not pulled: {exc}") from None
    progress.finish()
    how = f", {pulled.linked_files} hard-linked" if pulled.linked_files else ""
    checked = "verified against the source manifest" if pulled.source_manifest else "manifest written"
    click.echo(
        f"pulled {pulled.name}/{pulled.version}: {pulled.files} files{how}, "
        f"{pulled.size_bytes / 1e6:.1f} MB at {pulled.path} ({checked})"
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
