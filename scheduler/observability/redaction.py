"""Log redaction of credentials, wherever they hide in an event (``redact_secrets``).

``scheduler.observability.logging`` already replaces top-level keys named like a secret (``authorization``,
``token``...) and drops payloads unless ``CLOVERQ_LOG_PAYLOADS=true``; it picks up
:func:`redact_secrets` from this module and runs it on every structlog event and stdlib record.
This processor covers what a key-name check cannot see:

- an API key (``cloverq_<id>_<secret>``, or a legacy ``cq_<id>_<secret>``) or a ``Bearer`` token
  inside any string value, e.g. an exception message or a stdlib record that formatted a header;
- the password of a URL (``postgresql://user:PASSWORD@host``, ``redis://:PASSWORD@host``), also
  one holding an unencoded ``@`` (up to the token's last ``@``), and of a percent-encoded URL in
  a query string (``?webhook_url=https%3A%2F%2Fuser%3APASSWORD%40host``: uvicorn's access log
  writes the raw target, issue 16);
- secret-named keys nested inside dicts and lists (e.g. ``headers={"Authorization": ...}``).

Key ids stay visible (``cloverq_<id>_[redacted]``): they are not secret and make audit lines useful.
"""

from __future__ import annotations

import re
from typing import Any

from structlog.types import EventDict, WrappedLogger

from scheduler.access.key_format import KEY_SEARCH_PATTERN

REDACTED = "[redacted]"
SECRET_NAMES: frozenset[str] = frozenset(
    {
        "authorization",
        "api_key",
        "apikey",
        "key",
        "secret",
        "password",
        "passwd",
        "token",
        "bearer",
        "cookie",
        "set-cookie",
        "x-api-key",
        "key_hash",
    }
)
_BEARER = re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=\-]+")
# The password runs to the last "@" of the token (a password may hold a raw "@" or "/").
_URL_PASSWORD = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.\-]*://)(?P<user>[^:/@\s]*):(?P<password>(?:[^@\s]|@(?=\S*@))+)@")
# The same inside a percent-encoded URL (":" is %3A, "@" is %40; a "@" of the password is %2540).
_ENCODED_URL_PASSWORD = re.compile(
    r"(?i)(?P<scheme>[a-z][a-z0-9+.\-]*%3A%2F%2F)(?P<user>(?:[^/\s&%@:]|%(?!3A|2F)[0-9A-F]{2})*)%3A"
    r"(?:[^/\s&%@]|%(?!40)[0-9A-F]{2})+%40")
# A password in a URL's query (redis+sentinel://...?sentinel_password=...).
_QUERY_PASSWORD = re.compile(r"(?i)([?&][a-z_]*password=)[^&\s#]+")
_MAX_DEPTH = 6


def redact_text(text: str) -> str:
    """``text`` with API keys, bearer tokens and URL passwords masked."""
    if "cq_" in text or "cloverq_" in text:
        text = KEY_SEARCH_PATTERN.sub(lambda m: f"{m.group('visible')}_{REDACTED}", text)
    if "earer" in text or "EARER" in text:
        text = _BEARER.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    if "://" in text:
        text = _URL_PASSWORD.sub(lambda m: f"{m.group('scheme')}{m.group('user')}:{REDACTED}@", text)
    if "password=" in text.lower():
        text = _QUERY_PASSWORD.sub(lambda m: f"{m.group(1)}{REDACTED}", text)
    if "%3A%2F%2F" in text or "%3a%2f%2f" in text:
        text = _ENCODED_URL_PASSWORD.sub(
            lambda m: f"{m.group('scheme')}{m.group('user')}%3A{REDACTED}%40", text)
    return text


def redact_value(value: Any, depth: int = 0) -> Any:
    """A copy of ``value`` with secrets masked (strings, and dicts / lists / tuples inside)."""
    if isinstance(value, str):
        return redact_text(value)
    if depth >= _MAX_DEPTH:
        return value
    if isinstance(value, dict):
        return {
            name: REDACTED if isinstance(name, str) and name.lower() in SECRET_NAMES
            else redact_value(item, depth + 1)
            for name, item in value.items()
        }
    if isinstance(value, list | tuple):
        return type(value)(redact_value(item, depth + 1) for item in value)
    return value


def redact_secrets(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    """structlog processor: mask credentials in every value of the event."""
    for name, value in list(event_dict.items()):
        if isinstance(name, str) and name.lower() in SECRET_NAMES:
            event_dict[name] = REDACTED
        elif isinstance(value, str | dict | list | tuple):
            event_dict[name] = redact_value(value)
    return event_dict
