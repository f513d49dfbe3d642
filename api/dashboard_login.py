"""One-time sign-in links for the dashboard (issue 33): ``cloverq up`` prints
``<url>/dashboard#login=<code>`` and the page trades the code, once, for the key.

Never a key in a URL: the code travels in the fragment, which browsers do not send (so no
access log, proxy or Referer sees it), and the page POSTs it in a body. Redis keeps the key
under a hash of the code for ``LOGIN_TTL_SECONDS``, taken with GETDEL, so a code works once.
The key handed over is the one ``up`` already prints and keeps in ``data_dir/dev_api_key``.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from scheduler.infra.redis_keys import PREFIX

LOGIN_TTL_SECONDS = 600


def _redis_key(code: str) -> str:
    return f"{PREFIX}:dashboard-login:{hashlib.sha256(code.encode()).hexdigest()}"


def issue_login_code(redis_client: Any, api_key: str, *, ttl: int = LOGIN_TTL_SECONDS) -> str:
    """A fresh code that :func:`redeem_login_code` turns into ``api_key`` once, within ``ttl`` s."""
    code = secrets.token_urlsafe(24)
    redis_client.set(_redis_key(code), api_key, ex=ttl)
    return code


def redeem_login_code(redis_client: Any, code: str) -> str | None:
    """The key behind ``code``, removed in the same step (a second use gets None)."""
    value = redis_client.getdel(_redis_key(code))
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def login_link(base_url: str, code: str) -> str:
    return f"{base_url}/dashboard#login={code}"
