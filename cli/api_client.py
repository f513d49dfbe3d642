"""How the CLI's client commands reach the API: the Python client (``client/``) built from the
settings, and its errors turned into clean CLI errors. There is no HTTP code in ``cli/``.

Where they look, first found wins (:func:`resolve_target`):

- the URL: ``cloverq --url URL <command>``, ``CLOVERQ_API_URL``, the stack ``cloverq up`` recorded
  (``cli/stack_record.py``: works from any folder), else http://127.0.0.1:8000; the admin and ops
  planes' (``cloverq top``, readiness) from ``CLOVERQ_ADMIN_API_URL`` / ``CLOVERQ_OPS_API_URL``, else
  the record's when the URL is the recorded stack's, else the same URL;
- the key: ``cloverq --key KEY <command>``, ``CLOVERQ_API_KEY``, the dev key ``cloverq up`` left in
  ``data_dir/dev_api_key`` (``CLOVERQ_DATA_DIR``, default ``./.cloverq``), else the recorded
  stack's dev key. A refusal says which of these was sent, or that none was and how to give one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import click
import httpx

from cli.stack_record import read_record, record_path
from client import Client, CloverqError, JobTimeout
from scheduler.access.dev_key import DEV_KEY_FILE
from scheduler.infra.settings import Settings, get_settings

HOW_TO_GIVE_A_KEY = ("pass `cloverq --key KEY <command>`, set CLOVERQ_API_KEY, or run `cloverq up` (it "
                     "records its dev key for the CLI; or set CLOVERQ_DATA_DIR to the folder it runs in)")


@dataclass(frozen=True)
class Target:
    """Where a CLI command sends its requests and with which key (``key_source`` says where the
    key came from, for error messages; never the key itself)."""

    url: str
    key: str | None
    key_source: str | None
    url_source: str
    admin_url: str | None = None  # the admin plane's, where the API serves it on its own port
    ops_url: str | None = None

    def describe_key(self) -> str:
        return f"the key from {self.key_source}" if self.key_source else "no key"


def root_options() -> dict[str, Any]:
    """The top-level group's parameters (``cloverq --url URL --key KEY <command>``), or none
    outside a click command."""
    ctx = click.get_current_context(silent=True)
    return dict(ctx.find_root().params) if ctx is not None else {}


def resolve_target(settings: Settings, url: str | None = None, key: str | None = None) -> Target:
    """The URL and key a command uses (see the module docstring for the order); ``url``/``key``
    unset: the ``cloverq --url/--key`` given before the command, if any."""
    given = root_options()
    url, key = url or given.get("url"), key or given.get("key")
    record = read_record(settings)
    if url:
        url_source, base = "--url", url
    elif "api_url" in settings.client.model_fields_set:
        url_source, base = "CLOVERQ_API_URL", settings.client.api_url
    elif record is not None:
        url_source, base = f"the running `cloverq up` ({record_path(settings)})", record.api_url
    else:
        url_source, base = "the default", settings.client.api_url
    this_stack = record if record is not None and base == record.api_url else None
    planes = {"admin_url": settings.client.admin_api_url or (this_stack.admin_url if this_stack else None),
              "ops_url": settings.client.ops_api_url or (this_stack.ops_url if this_stack else None)}
    if key:
        return Target(base, key, "--key", url_source, **planes)
    if settings.client.api_key:
        return Target(base, settings.client.api_key, "CLOVERQ_API_KEY", url_source, **planes)
    local = settings.data_dir / DEV_KEY_FILE
    if local.is_file():
        return Target(base, local.read_text().strip(), str(local.resolve()), url_source, **planes)
    if record is not None and "data_dir" not in settings.model_fields_set:
        recorded = record.data_dir / DEV_KEY_FILE
        if recorded.is_file():
            return Target(base, recorded.read_text().strip(), str(recorded), url_source, **planes)
    return Target(base, None, None, url_source, **planes)


def api_key(settings: Settings) -> str | None:
    """The key :func:`resolve_target` finds without ``--key``."""
    return resolve_target(settings).key


def refusal_hint(target: Target, status: int) -> str:
    """What to do about a 401/403, saying what was sent."""
    if target.key is None:
        return f"no API key was sent: {HOW_TO_GIVE_A_KEY}"
    if status == 401:
        return f"the API did not accept {target.describe_key()} (unknown, revoked or expired)"
    return f"{target.describe_key()} lacks the scope this needs"


def click_error(exc: CloverqError, target: Target | None = None) -> click.ClickException:
    """The API's error as a CLI error: ``code (HTTP status): message`` and the details; for a
    refused key, what was sent and how to fix it."""
    suffix = f"\n{json.dumps(exc.details, indent=2)}" if exc.details else ""
    hint = f"\n{refusal_hint(target, exc.status)}" if target is not None and exc.status in (401, 403) else ""
    return click.ClickException(f"{exc.code} (HTTP {exc.status}): {exc.message}{suffix}{hint}")


@contextmanager
def api_client(url: str | None = None, key: str | None = None, *, timeout: float = 30.0) -> Iterator[Client]:
    """A :class:`client.Client` for the configured API; API and connection errors become
    ``click.ClickException`` s that say what went wrong and where."""
    target = resolve_target(get_settings(), url, key)
    with Client(target.url, target.key, timeout=timeout, admin_url=target.admin_url,
                ops_url=target.ops_url) as cq:
        try:
            yield cq
        except CloverqError as exc:
            raise click_error(exc, target) from None
        except JobTimeout as exc:
            raise click.ClickException(str(exc)) from None
        except httpx.TransportError as exc:  # the API is not there: say where we looked
            raise click.ClickException(
                f"cannot reach the cloverq API at {target.url} (from {target.url_source}; {exc}); "
                "is it running (`cloverq up`)? set CLOVERQ_API_URL or pass `cloverq --url URL <command>` to "
                "point elsewhere"
            ) from None


def echo_json(value: Any) -> None:
    """Print a model or a plain value as indented JSON (stdout)."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json", exclude_unset=False)
    click.echo(json.dumps(value, indent=2, default=str))
