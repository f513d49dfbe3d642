"""The development key of the embedded default (what ``cloverq up`` prints), kept in ``data_dir``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sqlalchemy.orm import Session

from scheduler.access.api_keys import ALL_SCOPES, create_key
from scheduler.access.key_authenticator import KeyAuthenticator
from scheduler.observability.audit import audit

DEV_KEY_FILE = "dev_api_key"  # under data_dir: the key `cloverq up` prints (embedded default only)


def ensure_dev_key(session_factory: Callable[[], Session], *, data_dir: Path) -> str:
    """The development key of the embedded default (what ``cloverq up`` prints).

    The secret cannot be recovered from the table, so the key is kept in
    ``data_dir/dev_api_key`` (mode 0600) and reused while it still authenticates; otherwise a
    fresh one (tenant ``default``, all scopes) is created and written there. This file is a
    convenience of the single-machine dev setup: production keys come from ``keys create``.
    """
    path = Path(data_dir) / DEV_KEY_FILE
    authenticator = KeyAuthenticator(session_factory, cache_seconds=0)
    if path.exists():
        existing = path.read_text().strip()
        if authenticator.authenticate(existing) is not None:
            return existing
    with session_factory() as session:
        created = create_key(session, tenant="default", scopes=ALL_SCOPES, label="dev key (cloverq up)")
    audit("key.create", actor_tenant=None, actor_key_id=None, via="up", target=created.info.key_id,
          tenant="default", scopes=sorted(ALL_SCOPES))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(created.key + "\n")
    path.chmod(0o600)
    return created.key
