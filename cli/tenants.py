"""``cloverq tenants weight | weights``: a tenant's fair-share weight from the command line.

The same operator record as ``PUT /v1/admin/tenants/{tenant}/weight``: committed to the
``operator_state`` table, then written to Redis (``scheduler.fleet.operator_state.update_limits``),
so it survives a Redis restart. Uses the service's ``Settings`` (``CLOVERQ_DATABASE_URL`` and
``CLOVERQ_REDIS_URL``), migrates the database first (idempotent) and writes an audit line.
"""

from __future__ import annotations

import click

from cli.keys import _sessions
from cli.stack_record import stack_settings
from scheduler.access.api_keys import TENANT_PATTERN
from scheduler.fairness.held import held_by_tenant
from scheduler.fairness.weights import DEFAULT_WEIGHT, MAX_WEIGHT, MIN_WEIGHT, read_weights, weight_field
from scheduler.fleet.operator_state import update_limits
from scheduler.infra.queue_names import JOB_QUEUES
from scheduler.infra.redis_client import get_redis
from scheduler.observability.audit import audit


@click.group("tenants")
def tenants_group() -> None:
    """Per-tenant operator settings: fair-share weights."""


@tenants_group.command("weight")
@click.argument("tenant")
@click.argument("weight", type=click.FloatRange(MIN_WEIGHT, MAX_WEIGHT), required=False)
@click.option("--clear", is_flag=True, help="Drop the override: back to the default weight (1).")
def weight_command(tenant: str, weight: float | None, clear: bool) -> None:
    """Set TENANT's fair-share weight (e.g. 3: three times the capacity of a tenant of weight 1
    while both wait in a class), or drop it with --clear."""
    if not TENANT_PATTERN.match(tenant):
        raise click.BadParameter("1-64 chars of letters, digits, '_', '.', '-'", param_hint="TENANT")
    if (weight is None) == (not clear):
        raise click.UsageError("give a WEIGHT or --clear")
    settings = stack_settings()
    with _sessions(settings)() as session:
        update_limits(session, get_redis(settings.resolved_redis_url), {weight_field(tenant): weight})
    audit("tenant.weight", actor_tenant=None, actor_key_id=None, via="cli", target=tenant, weight=weight)
    click.echo(f"tenant {tenant}: weight {weight if weight is not None else DEFAULT_WEIGHT:g}"
               f"{'' if weight is not None else ' (default)'}")


@tenants_group.command("weights")
def weights_command() -> None:
    """Every weight override, and the jobs each tenant has held by fair share per class."""
    settings = stack_settings()
    client = get_redis(settings.resolved_redis_url)
    weights = read_weights(client)
    held = held_by_tenant(client, JOB_QUEUES)
    tenants = sorted(set(weights) | {tenant for _, tenant in held})
    click.echo(f"{'TENANT':<24}{'WEIGHT':>8}  HELD ({', '.join(JOB_QUEUES)})")
    for tenant in tenants:
        counts = ", ".join(str(held.get((queue, tenant), 0)) for queue in JOB_QUEUES)
        click.echo(f"{tenant:<24}{weights.get(tenant, DEFAULT_WEIGHT):>8g}  {counts}")
    if not tenants:
        click.echo(f"(no overrides; every tenant has weight {DEFAULT_WEIGHT:g}; nothing held)")


def register(group: click.Group) -> None:
    """Add the ``tenants`` group to the ``cloverq`` CLI."""
    group.add_command(tenants_group)
