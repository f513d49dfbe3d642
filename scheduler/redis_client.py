"""Shared Redis clients (one connection pool per URL per process)."""

from __future__ import annotations

from functools import lru_cache

import redis


@lru_cache(maxsize=8)
def get_redis(url: str) -> redis.Redis:
    """A client for ``url`` with short timeouts: Redis trouble must fail fast, never hang a request."""
    return redis.Redis.from_url(
        url, socket_timeout=5, socket_connect_timeout=2, health_check_interval=30, decode_responses=True
    )
