"""The process' synchronous Redis client: one client, so one connection pool, per URL.

Every synchronous Redis user of a process gets its client from :func:`get_redis`: in the API
the request paths (``app.state.redis``), authentication's rate limit and admission
(``api.auth.Security``) and the admin routes; elsewhere the worker, beat and the CLI. One pool
per URL per process means one set of connections, one place for the timeouts, and no client
that forgets them.

The timeouts are short on purpose: a Redis that hangs must fail a request fast, never hang it.
Every API request with a key takes its rate-limit token over this client, so a read waits at
most :data:`SOCKET_TIMEOUT_SECONDS` and a connect :data:`CONNECT_TIMEOUT_SECONDS`. Nothing
synchronous blocks on Redis on purpose (no ``BLPOP``, no blocking ``XREAD``): the API's long
waits (pub/sub, ``XREAD BLOCK``) use its asyncio client (``api/job_follow.py``
``stream_redis``). The pool is never closed: it lives as long as the process (redis-py
replaces its connections after a fork).
"""

from __future__ import annotations

import threading

import redis

SOCKET_TIMEOUT_SECONDS = 2.0  # one command's reply (the API's per-request rate-limit check rides on it)
CONNECT_TIMEOUT_SECONDS = 1.0
HEALTH_CHECK_SECONDS = 30  # a connection idle this long is PINGed before its next command

_clients: dict[str, redis.Redis] = {}
_lock = threading.Lock()


def get_redis(url: str) -> redis.Redis:
    """The process' client for ``url`` (created on first use; ``decode_responses``: str replies)."""
    client = _clients.get(url)
    if client is None:
        with _lock:  # two threads asking first must not build two pools
            client = _clients.get(url)
            if client is None:
                client = redis.Redis.from_url(
                    url, socket_timeout=SOCKET_TIMEOUT_SECONDS,
                    socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
                    health_check_interval=HEALTH_CHECK_SECONDS, decode_responses=True,
                )
                _clients[url] = client
    return client
