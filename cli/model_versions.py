"""``cloverq model activate NAME VERSION`` and ``cloverq model versions``: switch model versions.

The same operation as ``POST /v1/admin/models/{name}/activate``, run where the database (and
usually the model store) is reachable: a version published in the store but never registered
is registered on the way. Workers serving the model (``CLOVERQ_SERVED_MODEL``) notice within
``model_watch_interval_seconds``, drain, load it, warm up and take jobs again. Rolling back is
activating the previous version (``cloverq model rollback NAME`` does exactly that); no weights
are copied. Every activation writes an audit line.
"""

from __future__ import annotations

import json
import logging

import click
import redis
from rich.console import Console
from rich.table import Table
from sqlalchemy.orm import Session, sessionmaker

from cli.model import model_group
from cli.stack_record import stack_settings
from scheduler.fleet.workers import list_workers
from scheduler.infra.db import make_engine, migrate, session_factory
from scheduler.infra.redis_client import get_redis
from scheduler.infra.settings import Settings
from scheduler.model_versions.registry import (
    Activation,
    UnknownModelVersion,
    activate,
    active_version,
    list_active,
    list_registered,
)
from scheduler.observability.audit import audit
from scheduler.observability.logging import configure_logging
from worker import model_store


def _sessions(settings: Settings) -> sessionmaker[Session]:
    configure_logging(settings)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # migrate() is idempotent; keep it quiet
    url = settings.resolved_database_url
    migrate(url)
    return session_factory(make_engine(url))


def _activate(name: str, version: str) -> Activation:
    """Activate, audit, and say so when no worker serves the model (``note_if_unserved``)."""
    settings = stack_settings()
    try:
        model_store.validate_component(name, what="model name")
        model_store.validate_component(version, what="version")
        with _sessions(settings)() as session:
            result = activate(session, name=name, version=version, actor="cli",
                              store_root=settings.resolved_model_root)
            unserved = served_nowhere(settings, session, name)
    except (UnknownModelVersion, model_store.ModelStoreError) as exc:
        raise click.ClickException(f"{exc} (pull it first: cloverq model pull SRC --name {name} "
                                   f"--version {version})") from exc
    audit("model.activate", actor_tenant=None, actor_key_id=None, via="cli", target=name,
          version=result.version, previous=result.previous_version, generation=result.generation)
    _echo_activation(result)
    if unserved:
        note_unserved(name)
    return result


def _echo_activation(result: Activation) -> None:
    previous = f" (previous: {result.previous_version})" if result.previous_version else ""
    click.echo(f"{result.name}: active version {result.version}{previous}, activation #{result.generation}")


def served_nowhere(settings: Settings, session: Session, name: str) -> bool:
    """Whether no ready worker serves any registered version of model ``name`` (False when the
    worker registry cannot be read: the note it leads to is a courtesy, not a check)."""
    try:
        workers = list_workers(get_redis(settings.resolved_redis_url))
    except (redis.RedisError, OSError):
        return False
    versions = {row.version for row in list_registered(session, name=name)}
    return not any(w.is_ready and (w.model_version or "").split("@", 1)[0] in versions for w in workers)


def note_unserved(name: str) -> None:
    """The change is recorded, but moves no job until workers serve the model (an operator
    otherwise sees a canary "at 10%" that routes nothing)."""
    click.echo(f"note: no ready worker serves model {name!r} now; the change is recorded and moves jobs "
               f"once workers run with CLOVERQ_SERVED_MODEL={name}", err=True)  # fmt: skip


@click.command("activate")
@click.argument("name")
@click.argument("version")
def activate_command(name: str, version: str) -> None:
    """Make VERSION the active version of model NAME; serving workers switch to it."""
    _activate(name, version)


@click.command("rollback")
@click.argument("name")
def rollback_command(name: str) -> None:
    """Activate the version that was active before the current one of model NAME."""
    with _sessions(stack_settings())() as session:
        current = active_version(session, name=name)
    if current is None or current.previous_version is None:
        raise click.ClickException(f"model {name!r} has no previous version to roll back to")
    _activate(name, current.previous_version)


@click.command("versions")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="One JSON array on stdout.")
def versions_command(name: str | None, as_json: bool) -> None:
    """Registered versions (SQL) and published ones (store), with the active one marked."""
    settings = stack_settings()
    with _sessions(settings)() as session:
        registered = list_registered(session, name=name)
        active = list_active(session)
    try:
        in_store = model_store.list_versions(settings.resolved_model_root, name=name)
    except model_store.ModelStoreError as exc:
        raise click.ClickException(str(exc)) from exc
    rows: dict[tuple[str, str], dict[str, object]] = {}
    for v in in_store:
        rows[(v.name, v.version)] = {"name": v.name, "version": v.version, "path": str(v.path),
                                     "registered": False, "in_store": True}
    for r in registered:
        row = rows.setdefault((r.name, r.version), {"name": r.name, "version": r.version, "path": r.path,
                                                    "in_store": False})
        row["registered"] = True
    for (model, version), row in rows.items():
        current = active.get(model)
        row["active"] = current is not None and current.version == version
        row["previous"] = current is not None and current.previous_version == version
    ordered = [rows[key] for key in sorted(rows)]
    if as_json:
        click.echo(json.dumps(ordered))
        return
    if not ordered:
        click.echo("no model versions registered or in the store")
        return
    table = Table("name", "version", "active", "registered", "in store", "path")
    for row in ordered:
        mark = "active" if row["active"] else ("previous" if row["previous"] else "")
        table.add_row(str(row["name"]), str(row["version"]), mark, "yes" if row["registered"] else "no",
                      "yes" if row["in_store"] else "no", str(row["path"]))
    Console().print(table)


def register(group: click.Group) -> None:
    """Add ``activate``, ``rollback`` and ``versions`` to the ``model`` group."""
    model = model_group(group)
    model.add_command(activate_command)
    model.add_command(rollback_command)
    model.add_command(versions_command)
