"""``cloverq keys create | list | revoke``: manage API keys from the command line.

Uses the same ``Settings`` as the service (``CLOVERQ_DATABASE_URL``, or SQLite under
``CLOVERQ_DATA_DIR``), migrates the database first (idempotent), and writes an audit line
(stderr, JSON) for every change. ``create`` prints the new key once, alone on the last line of
stdout, so a script can take it with ``| tail -n 1``.
"""

from __future__ import annotations

import logging

import click
import redis
from sqlalchemy.orm import Session, sessionmaker

from scheduler.access.admission import mark_revoked
from scheduler.access.api_keys import (
    DEFAULT_SCOPES,
    InvalidKeyRequest,
    create_key,
    list_keys,
    parse_scopes,
    revoke_key,
)
from scheduler.infra.db import make_engine, migrate, session_factory
from scheduler.infra.redis_client import get_redis
from scheduler.infra.settings import Settings, get_settings
from scheduler.observability.audit import audit
from scheduler.observability.logging import configure_logging


def _sessions(settings: Settings) -> sessionmaker[Session]:
    configure_logging(settings)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # migrate() is idempotent; keep it quiet
    url = settings.resolved_database_url
    migrate(url)
    return session_factory(make_engine(url))


@click.group("keys")
def keys_group() -> None:
    """Create, list and revoke API keys (only a hash of each key is stored)."""


@keys_group.command("create")
@click.option("--tenant", required=True, help="Tenant the key acts for.")
@click.option("--scopes", default=",".join(sorted(DEFAULT_SCOPES)), show_default=True,
              help="Comma-separated: submit, read, admin (admin sees every tenant).")
@click.option("--label", default=None, help="A note to recognise the key by in `keys list`.")
def create_command(tenant: str, scopes: str, label: str | None) -> None:
    """Create a key and print it ONCE (last line of stdout); it cannot be shown again."""
    settings = get_settings()
    try:
        scope_set = parse_scopes(scopes)
        with _sessions(settings)() as session:
            created = create_key(session, tenant=tenant, scopes=scope_set, label=label)
    except InvalidKeyRequest as exc:
        raise click.BadParameter(str(exc)) from exc
    audit("key.create", actor_tenant=None, actor_key_id=None, via="cli", target=created.info.key_id,
          tenant=tenant, scopes=sorted(created.info.scopes))
    click.echo(f"key id: {created.info.key_id}  tenant: {tenant}  scopes: {','.join(sorted(scope_set))}")
    click.echo("Store this key now; it is shown only once:")
    click.echo(created.key)


@keys_group.command("list")
@click.option("--tenant", default=None, help="Only this tenant's keys.")
@click.option("--active", is_flag=True, help="Hide revoked keys.")
def list_command(tenant: str | None, active: bool) -> None:
    """List keys (ids, tenants, scopes, state); secrets are never stored, so never shown."""
    settings = get_settings()
    with _sessions(settings)() as session:
        keys = list_keys(session, tenant=tenant, include_revoked=not active)
    click.echo(f"{'KEY ID':<14}{'TENANT':<20}{'SCOPES':<22}{'STATE':<9}{'CREATED':<27}LABEL")
    for info in keys:
        state = "revoked" if info.revoked else "active"
        created = info.created_at.isoformat(timespec="seconds")
        click.echo(f"{info.key_id:<14}{info.tenant:<20}{','.join(sorted(info.scopes)):<22}"
                   f"{state:<9}{created:<27}{info.label or ''}")


@keys_group.command("revoke")
@click.argument("key_id")
def revoke_command(key_id: str) -> None:
    """Revoke a key by id (the key row is kept for the audit trail)."""
    settings = get_settings()
    if key_id.startswith("cq_"):  # accept a whole key too, but only ever use its id
        key_id = key_id.split("_", 2)[1]
    with _sessions(settings)() as session:
        info = revoke_key(session, key_id=key_id)
    if info is None:
        raise click.ClickException(f"no key with id {key_id!r}")
    try:
        mark_revoked(get_redis(settings.resolved_redis_url), [key_id])
        immediate = True
    except redis.RedisError:
        immediate = False
    audit("key.revoke", actor_tenant=None, actor_key_id=None, via="cli", target=key_id, tenant=info.tenant)
    when = "now" if immediate else f"within {settings.security.auth_cache_seconds:g}s (Redis not reachable)"
    click.echo(f"revoked {key_id} (tenant {info.tenant}); API processes refuse it {when}")


def register(group: click.Group) -> None:
    """Add the ``keys`` group to the ``cloverq`` CLI."""
    group.add_command(keys_group)
