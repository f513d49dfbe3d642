"""How the CLI's client commands reach the API: the Python client (``client/``) built from the
settings, and its errors turned into clean CLI errors. There is no HTTP code in ``cli/``.

The commands talk to ``CLOVERQ_API_URL`` (default http://127.0.0.1:8000) with
``CLOVERQ_API_KEY`` or, for the embedded default, the dev key ``cloverq up`` left in
``data_dir/dev_api_key``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click
import httpx

from client import Client, CloverqError, JobTimeout
from scheduler.keys import DEV_KEY_FILE
from scheduler.settings import Settings, get_settings


def api_key(settings: Settings) -> str | None:
    """``CLOVERQ_API_KEY``, else the dev key ``cloverq up`` wrote, else none."""
    if settings.client.api_key:
        return settings.client.api_key
    path = settings.data_dir / DEV_KEY_FILE
    return path.read_text().strip() if path.is_file() else None


def click_error(exc: CloverqError) -> click.ClickException:
    """The API's error as a CLI error: ``code (HTTP status): message`` and the details."""
    suffix = f"\n{json.dumps(exc.details, indent=2)}" if exc.details else ""
    return click.ClickException(f"{exc.code} (HTTP {exc.status}): {exc.message}{suffix}")


@contextmanager
def api_client(url: str | None = None, key: str | None = None, *, timeout: float = 30.0) -> Iterator[Client]:
    """A :class:`client.Client` for the configured API; API and connection errors become
    ``click.ClickException`` s that say what went wrong and where."""
    settings = get_settings()
    base = url or settings.client.api_url
    with Client(base, key or api_key(settings), timeout=timeout) as cq:
        try:
            yield cq
        except CloverqError as exc:
            raise click_error(exc) from None
        except JobTimeout as exc:
            raise click.ClickException(str(exc)) from None
        except httpx.TransportError as exc:  # the API is not there: say where we looked
            raise click.ClickException(
                f"cannot reach the cloverq API at {base} ({exc}); "
                "is it running? set CLOVERQ_API_URL to point elsewhere"
            ) from None


def echo_json(value: Any) -> None:
    """Print a model or a plain value as indented JSON (stdout)."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json", exclude_unset=False)
    click.echo(json.dumps(value, indent=2, default=str))
