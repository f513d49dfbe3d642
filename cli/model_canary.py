"""``cloverq model canary NAME VERSION --percent P``, ``promote NAME`` and ``abort NAME``.

The same operations as ``POST /v1/admin/models/{name}/canary|promote|abort``
(``scheduler/model_versions/canary.py``), run where the database (and usually the model store) is reachable.
Canary workers (``CLOVERQ_MODEL_TRACK=canary``) switch to the canary version, new jobs are routed
by the hash of their id, ``promote`` moves the whole fleet to the canary (refused by the gate of
``scheduler/model_versions/canary_gate.py`` unless ``--force``), ``abort`` returns the canary workers to the
stable version. Every call writes an audit line.
"""

from __future__ import annotations

import json

import click

from cli.model import model_group
from cli.model_versions import _sessions, note_unserved, served_nowhere
from cli.stack_record import stack_settings
from scheduler.model_versions.canary import CanaryConflict, abort_canary, promote_canary, start_canary
from scheduler.model_versions.canary_gate import check_promotion
from scheduler.model_versions.registry import Activation, UnknownModelVersion, active_version
from scheduler.observability.audit import audit
from worker import model_store


def _echo(result: Activation) -> None:
    if result.canary_version:
        click.echo(f"{result.name}: stable {result.version}, canary {result.canary_version} at "
                   f"{result.canary_basis_points / 100:g}% of new jobs")
    else:
        previous = f" (previous: {result.previous_version})" if result.previous_version else ""
        click.echo(f"{result.name}: active version {result.version}{previous}, no canary")


@click.command("canary")
@click.argument("name")
@click.argument("version")
@click.option("--percent", type=click.FloatRange(0.01, 99.99), required=True,
              help="Share of new jobs routed to VERSION, in percent (0.01-99.99).")
def canary_command(name: str, version: str, percent: float) -> None:
    """Send PERCENT % of new jobs of model NAME to VERSION, served by the canary workers."""
    settings = stack_settings()
    try:
        model_store.validate_component(name, what="model name")
        model_store.validate_component(version, what="version")
        with _sessions(settings)() as session:
            result = start_canary(session, name=name, version=version, percent=percent, actor="cli",
                                  store_root=settings.resolved_model_root)
            unserved = served_nowhere(settings, session, name)
    except (UnknownModelVersion, model_store.ModelStoreError, CanaryConflict, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    audit("model.canary", actor_tenant=None, actor_key_id=None, via="cli", target=name, version=version,
          percent=percent, stable=result.version)
    _echo(result)
    if unserved:
        note_unserved(name)


@click.command("promote")
@click.argument("name")
@click.option("--force", is_flag=True, help="Promote although the canary served too few jobs or fails more.")
@click.option("--require-golden/--no-require-golden", default=None,
              help="Refuse unless the canary's last golden check passed "
              "[default: CLOVERQ_CANARY_REQUIRE_GOLDEN].")
def promote_command(name: str, force: bool, require_golden: bool | None) -> None:
    """Make the canary the active version of model NAME: the whole fleet moves to it."""
    settings = stack_settings()
    with _sessions(settings)() as session:
        current = active_version(session, name=name)
        if current is None or current.canary_version is None:
            raise click.ClickException(f"model {name!r} has no canary in effect")
        report = check_promotion(session, activation=current, settings=settings,
                                 require_golden=require_golden)
        if not report.ok and not force:  # every reason at once: fixing one should not reveal the next
            raise click.ClickException(f"promotion refused: {'; '.join(report.reasons)} "
                                       f"(tallies: {json.dumps(report.as_dict())}; --force overrides)")
        try:
            result = promote_canary(session, name=name, actor="cli")
        except CanaryConflict as exc:
            raise click.ClickException(str(exc)) from exc
    audit("model.promote", actor_tenant=None, actor_key_id=None, via="cli", target=name,
          version=result.version, previous=result.previous_version, forced=force and not report.ok,
          gate=report.as_dict())
    _echo(result)


@click.command("abort")
@click.argument("name")
def abort_command(name: str) -> None:
    """End the canary of model NAME: its queued jobs and the canary workers return to stable."""
    with _sessions(stack_settings())() as session:
        try:
            result = abort_canary(session, name=name, actor="cli")
        except CanaryConflict as exc:
            raise click.ClickException(str(exc)) from exc
    audit("model.abort_canary", actor_tenant=None, actor_key_id=None, via="cli", target=name,
          stable=result.version)
    _echo(result)


def register(group: click.Group) -> None:
    """Add ``canary``, ``promote`` and ``abort`` to the ``model`` group."""
    model = model_group(group)
    model.add_command(canary_command)
    model.add_command(promote_command)
    model.add_command(abort_command)
