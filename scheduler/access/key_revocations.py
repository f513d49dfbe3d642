"""Revoked keys, told to every API process at once: the Redis set ``REVOKED_SET``, which the
admission rate script reads on every authenticated request (``scheduler.access.admission``), so
a revoked key is refused at once everywhere, before any authenticator cache expires. SQL holds
the revocation itself (``scheduler.access.api_keys``); this set is its fast mirror."""

from __future__ import annotations

from collections.abc import Iterable

import redis

from scheduler.infra.redis_keys import REVOKED_SET


def mark_revoked(client: redis.Redis, key_ids: Iterable[str]) -> None:
    """Tell every API process at once that these keys are refused (read by the rate script): a
    revoked key, or one rotated with no overlap (``scheduler.access.api_keys.rotate_key``)."""
    ids = list(key_ids)
    if ids:
        client.sadd(REVOKED_SET, *ids)
