"""Log redaction: keys, bearer tokens, URL passwords and nested secret fields never reach a line."""

from __future__ import annotations

import io
import json
import logging

import structlog

from scheduler.infra.redis_sentinel import parse_sentinel_url
from scheduler.infra.settings import Settings
from scheduler.observability.logging import configure_logging
from scheduler.observability.redaction import REDACTED, redact_secrets, redact_text

KEY = "cq_0123456789ab_" + "S3cr3t-_" * 5 + "xyz"


def test_api_keys_are_masked_but_the_key_id_stays() -> None:
    text = redact_text(f"auth failed for {KEY} at login")
    assert "S3cr3t" not in text
    assert "cq_0123456789ab" in text and REDACTED in text


def test_bearer_tokens_and_url_passwords_are_masked() -> None:
    assert redact_text("Authorization: Bearer abc.def-ghi") == f"Authorization: Bearer {REDACTED}"
    masked = redact_text("connect postgresql+psycopg://app:hunter2@db:5432/x failed")
    assert "hunter2" not in masked and "postgresql+psycopg://app:" in masked and "@db:5432/x" in masked
    assert "s3cret" not in redact_text("redis://:s3cret@cache:6379/0")


def test_passwords_with_raw_at_signs_and_percent_encoded_urls_are_masked() -> None:
    """Issue 16: the access log wrote ``?webhook_url=`` with its percent-encoded password."""
    masked = redact_text("postgresql+psycopg://app:p@ss/w0rd@db:5432/x?sslmode=require")
    assert masked == f"postgresql+psycopg://app:{REDACTED}@db:5432/x?sslmode=require"
    line = '"POST /v1/batches?webhook_url=https%3A%2F%2Fbob%3Ahun%2540ter%40hooks.example%2Fin HTTP/1.1" 202'
    masked = redact_text(line)
    assert "hun" not in masked and "ter" not in masked.split("%40")[0]
    assert f"https%3A%2F%2Fbob%3A{REDACTED}%40hooks.example%2Fin" in masked
    for kept in ("see https://example.com/a and mail me@x.org", "redis://cache:6379/0 for ops@x.org",
                 "?next=https%3A%2F%2Fexample.com%2Fa%3Fb%3Dc"):
        assert redact_text(kept) == kept


def test_sentinel_urls_lose_both_passwords_in_text_and_repr() -> None:
    url = ("rediss+sentinel://u:srvpw@127.0.0.1:26379,127.0.0.2:26379/svc"
           "?sentinel_password=sntpw&ssl_cert_reqs=none")
    masked = redact_text(url)
    assert "srvpw" not in masked and "sntpw" not in masked
    assert masked.endswith("?sentinel_password=[redacted]&ssl_cert_reqs=none")
    shown = repr(parse_sentinel_url(url))
    assert "srvpw" not in shown and "sntpw" not in shown and "svc" in shown


def test_nested_secret_fields_are_masked_and_other_values_kept() -> None:
    event = {
        "event": "request",
        "headers": {"Authorization": "Bearer x", "X-Request-ID": "r1", "cookie": "c"},
        "items": [{"password": "p", "n": 1}, f"key {KEY}"],
        "count": 3,
        "api_key": KEY,
    }
    out = redact_secrets(None, "info", event)
    assert out["headers"] == {"Authorization": REDACTED, "X-Request-ID": "r1", "cookie": REDACTED}
    assert out["items"][0] == {"password": REDACTED, "n": 1}
    assert "S3cr3t" not in json.dumps(out)
    assert out["count"] == 3 and out["api_key"] == REDACTED


def test_configured_logging_never_writes_a_key() -> None:
    """End to end through scheduler.observability.logging (which picks up redact_secrets)."""
    stream = io.StringIO()
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    configure_logging(Settings(log_level="INFO"), stream=stream)
    try:
        structlog.get_logger("t").info("login", detail=f"bad key {KEY}", headers={"authorization": KEY})
        logging.getLogger("uvicorn.error").warning("client sent %s", f"Bearer {KEY}")
    finally:
        structlog.reset_defaults()
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    output = stream.getvalue()
    assert "S3cr3t" not in output
    assert output.count("\n") >= 2
