"""``cloverq keys create | list | revoke | rotate | set-networks``: manage API keys from the command line.

Uses the same ``Settings`` as the service (``CLOVERQ_DATABASE_URL``, or SQLite under
``CLOVERQ_DATA_DIR``), migrates the database first (idempotent), and writes an audit line
(stderr, JSON) for every change. ``create`` and ``rotate`` print the new key once, alone on the
last line of stdout, so a script can take it with ``| tail -n 1``.
"""

from __future__ import annotations

import logging
import re
from datetime import datetime

import click
import redis
from sqlalchemy.orm import Session, sessionmaker

from cli.stack_record import stack_settings
from scheduler.access.api_keys import (
    DEFAULT_SCOPES,
    MAX_ROTATION_OVERLAP_SECONDS,
    InvalidKeyRequest,
    KeyInfo,
    KeyNotFound,
    KeyNotRotatable,
    create_key,
    list_keys,
    parse_scopes,
    revoke_key,
    rotate_key,
    set_key_networks,
)
from scheduler.access.key_format import key_id_of
from scheduler.access.key_revocations import mark_revoked
from scheduler.infra.db import make_engine, migrate, session_factory
from scheduler.infra.redis_client import get_redis
from scheduler.infra.settings import Settings
from scheduler.observability.audit import audit
from scheduler.observability.logging import configure_logging

_DURATION = re.compile(r"^\s*(?P<amount>\d+(?:\.\d+)?)\s*(?P<unit>[smhd]?)\s*$", re.IGNORECASE)
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    """Seconds of ``30s``, ``15m``, ``24h``, ``7d`` or a bare number of seconds; ValueError else."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 15m, 24h, 7d)")
    return round(float(match.group("amount")) * _UNIT_SECONDS[match.group("unit").lower()])


def _sessions(settings: Settings) -> sessionmaker[Session]:
    configure_logging(settings)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # migrate() is idempotent; keep it quiet
    url = settings.resolved_database_url
    migrate(url)
    return session_factory(make_engine(url))


def _mark_ended(settings: Settings, key_id: str) -> bool:
    """Tell every API process at once that ``key_id`` is refused (False: Redis not reachable)."""
    try:
        mark_revoked(get_redis(settings.resolved_redis_url), [key_id])
    except redis.RedisError:
        return False
    return True


def _networks_text(info: KeyInfo) -> str:
    return ",".join(info.networks) or "any"


@click.group("keys")
def keys_group() -> None:
    """Create, list, revoke and rotate API keys (only a hash of each key is stored)."""


@keys_group.command("create")
@click.option("--tenant", required=True, help="Tenant the key acts for.")
@click.option("--scopes", default=",".join(sorted(DEFAULT_SCOPES)), show_default=True,
              help="Comma-separated: submit, read, webhooks, admin (admin sees every tenant).")
@click.option("--label", default=None, help="A note to recognise the key by in `keys list`.")
@click.option("--allowed-network", "allowed_networks", multiple=True, metavar="CIDR",
              help="A network the key may be used from (repeatable); none: any address.")
def create_command(tenant: str, scopes: str, label: str | None, allowed_networks: tuple[str, ...]) -> None:
    """Create a key and print it ONCE (last line of stdout); it cannot be shown again."""
    settings = stack_settings()
    try:
        scope_set = parse_scopes(scopes)
        with _sessions(settings)() as session:
            created = create_key(session, tenant=tenant, scopes=scope_set, label=label,
                                 allowed_networks=allowed_networks)
    except InvalidKeyRequest as exc:
        raise click.BadParameter(str(exc)) from exc
    audit("key.create", actor_tenant=None, actor_key_id=None, via="cli", target=created.info.key_id,
          tenant=tenant, scopes=sorted(created.info.scopes), allowed_networks=created.info.networks)
    click.echo(f"key id: {created.info.key_id}  tenant: {tenant}  scopes: {','.join(sorted(scope_set))}"
               f"  networks: {_networks_text(created.info)}")
    click.echo("Store this key now; it is shown only once:")
    click.echo(created.key)


def _when(value: datetime | None) -> str:
    return value.isoformat(timespec="seconds") if value is not None else "-"


@keys_group.command("list")
@click.option("--tenant", default=None, help="Only this tenant's keys.")
@click.option("--active", is_flag=True,
              help="Only keys that work now (active or rotating): hide revoked and expired ones.")
def list_command(tenant: str | None, active: bool) -> None:
    """List keys (ids, tenants, scopes, state, expiry, last use, networks); secrets are never
    stored, so never shown. Last use is written by API processes at most once a minute each."""
    settings = stack_settings()
    with _sessions(settings)() as session:
        keys = list_keys(session, tenant=tenant, include_revoked=not active)
    if active:  # an expired key (a rotation's overlap ended) is refused as a revoked one is
        keys = [info for info in keys if info.state() in ("active", "rotating")]
    header = ["KEY ID", "TENANT", "SCOPES", "STATE", "CREATED", "EXPIRES", "LAST USED", "LAST ADDRESS",
              "NETWORKS", "ROTATED FROM", "LABEL"]
    rows = [[info.key_id, info.tenant, ",".join(sorted(info.scopes)), info.state(), _when(info.created_at),
             _when(info.expires_at), _when(info.last_used_at), info.last_used_address or "-",
             _networks_text(info), info.rotated_from or "-", info.label or ""] for info in keys]
    # each column as wide as its longest cell and two spaces: a long tenant or scope list never
    # runs into the next column
    widths = [max(len(row[i]) for row in [header, *rows]) + 2 for i in range(len(header) - 1)]
    for row in [header, *rows]:
        padded = "".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
        click.echo((padded + row[-1]).rstrip())


@keys_group.command("revoke")
@click.argument("key_id")
def revoke_command(key_id: str) -> None:
    """Revoke a key by id (the key row is kept for the audit trail)."""
    settings = stack_settings()
    key_id = key_id_of(key_id)  # accept a whole key too, but only ever use its id
    with _sessions(settings)() as session:
        info = revoke_key(session, key_id=key_id)
    if info is None:
        raise click.ClickException(f"no key with id {key_id!r}")
    immediate = _mark_ended(settings, key_id)
    audit("key.revoke", actor_tenant=None, actor_key_id=None, via="cli", target=key_id, tenant=info.tenant)
    when = "now" if immediate else f"within {settings.security.auth_cache_seconds:g}s (Redis not reachable)"
    click.echo(f"revoked {key_id} (tenant {info.tenant}); API processes refuse it {when}")


def _overlap(_: click.Context, __: click.Parameter, value: str) -> int:
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    if not 0 <= seconds <= MAX_ROTATION_OVERLAP_SECONDS:
        raise click.BadParameter("the overlap must be between 0 and 30d")
    return seconds


@keys_group.command("rotate")
@click.argument("key_id")
@click.option("--overlap", default="24h", show_default=True, callback=_overlap,
              help="How long the old key keeps working beside its successor: 30s, 15m, 24h, 7d "
              "(0: it ends now; at most 30d).")
def rotate_command(key_id: str, overlap: int) -> None:
    """Make a successor of a key (same tenant, scopes, label, networks) and print it ONCE (last
    line of stdout); the old key keeps working for the overlap, then is refused."""
    settings = stack_settings()
    key_id = key_id_of(key_id)
    try:
        with _sessions(settings)() as session:
            rotated = rotate_key(session, key_id=key_id, overlap_seconds=overlap)
    except KeyNotFound:
        raise click.ClickException(f"no key with id {key_id!r}") from None
    except (KeyNotRotatable, InvalidKeyRequest) as exc:
        raise click.ClickException(str(exc)) from None
    ended = overlap == 0 and _mark_ended(settings, key_id)
    successor = rotated.successor
    expires_at = rotated.previous.expires_at
    audit("key.rotate", actor_tenant=None, actor_key_id=None, via="cli", target=key_id,
          tenant=successor.info.tenant, previous_key_id=key_id, new_key_id=successor.info.key_id,
          overlap_seconds=overlap, previous_expires_at=expires_at.isoformat() if expires_at else None)
    old_ends = (f"ends at {_when(expires_at)}" if overlap else
                "ends now (revoked)" if ended else
                f"is revoked; API processes refuse it within {settings.security.auth_cache_seconds:g}s "
                "(Redis not reachable)")
    click.echo(f"rotated {key_id} -> {successor.info.key_id} (tenant {successor.info.tenant}); "
               f"the old key {old_ends}")
    click.echo("Store this key now; it is shown only once:")
    click.echo(successor.key)


@keys_group.command("set-networks")
@click.argument("key_id")
@click.option("--network", "networks", multiple=True, metavar="CIDR",
              help="A network the key may be used from (repeatable); replaces the key's list.")
@click.option("--any", "any_address", is_flag=True, help="Allow any address (clear the list).")
def set_networks_command(key_id: str, networks: tuple[str, ...], any_address: bool) -> None:
    """Replace the networks a key may be used from (API processes apply it within their key cache
    time, ``auth_cache_seconds``)."""
    if bool(networks) == any_address:
        raise click.UsageError("give either --network CIDR (one or more) or --any")
    settings = stack_settings()
    key_id = key_id_of(key_id)
    try:
        with _sessions(settings)() as session:
            info = set_key_networks(session, key_id=key_id, allowed_networks=networks)
    except InvalidKeyRequest as exc:
        raise click.BadParameter(str(exc), param_hint="--network") from exc
    except KeyNotFound:
        raise click.ClickException(f"no key with id {key_id!r}") from None
    audit("key.set_networks", actor_tenant=None, actor_key_id=None, via="cli", target=key_id,
          tenant=info.tenant, allowed_networks=info.networks)
    click.echo(f"key {key_id} (tenant {info.tenant}) may be used from: {_networks_text(info)}; API "
               f"processes apply it within {settings.security.auth_cache_seconds:g}s")


def register(group: click.Group) -> None:
    """Add the ``keys`` group to the ``cloverq`` CLI."""
    group.add_command(keys_group)
