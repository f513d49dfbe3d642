"""Webhook signatures and backoff (pure)."""

from __future__ import annotations

import hashlib
import hmac

from scheduler.infra.settings import Settings
from scheduler.webhooks.delivery import webhook_backoff_seconds
from scheduler.webhooks.signing import sign, signature_header, verify_signature

SECRET = "s3cret"
BODY = b'{"event":"job.finished","job":{"id":"1"}}'


def test_signature_is_hmac_sha256_over_timestamp_dot_body() -> None:
    header = signature_header(SECRET, 1700000000, BODY)
    expected = hmac.new(SECRET.encode(), b"1700000000." + BODY, hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={expected}"
    assert sign(SECRET, 1700000000, BODY) == expected


def test_verify_accepts_fresh_and_rejects_tampering_replay_and_wrong_secret() -> None:
    header = signature_header(SECRET, 1000, BODY)
    assert verify_signature(SECRET, header, BODY, now=1010)
    assert not verify_signature(SECRET, header, BODY + b" ", now=1010)  # body changed
    assert not verify_signature("other", header, BODY, now=1010)
    assert not verify_signature(SECRET, header, BODY, now=1000 + 301)  # too old: replay
    assert not verify_signature(SECRET, header.replace("t=1000", "t=1001"), BODY, now=1010)
    assert not verify_signature(SECRET, "garbage", BODY, now=1010)


def test_backoff_doubles_and_is_capped() -> None:
    settings = Settings(webhook_backoff_base_seconds=1.0, webhook_backoff_max_seconds=10.0)
    delays = [webhook_backoff_seconds(n, settings) for n in range(1, 8)]
    for n, delay in enumerate(delays[:4], start=1):
        assert 2 ** (n - 1) <= delay <= 1.25 * 2 ** (n - 1)
    assert all(10.0 <= d <= 12.5 for d in delays[4:])
