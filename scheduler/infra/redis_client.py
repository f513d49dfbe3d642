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

TLS: a ``rediss://`` URL connects over TLS and verifies the server's certificate (redis-py's
default, ``ssl_cert_reqs=required``), against the CA file named in the URL's query
(``rediss://host:6380/0?ssl_ca_certs=/etc/cloverq/ca.pem``; without it, the system's CAs) and
for the URL's host name. The same query carries a client certificate (``ssl_certfile``,
``ssl_keyfile``) for a server with ``tls-auth-clients yes``. Every client of cloverq reads that
one URL: this module's, the API's asyncio clients (``api/job_follow.py``) and the Celery broker,
which gets the same options through :func:`redis_ssl_options` (kombu would otherwise not verify
a ``rediss://`` server at all). docs/security.md "TLS to Redis and PostgreSQL".

Sentinel: a ``redis+sentinel://`` URL names the sentinels instead of a server, and every client
built here (:func:`redis_from_url`, :func:`async_redis_from_url`) then follows the master they
name through a failover (``scheduler.infra.redis_sentinel``); so does the broker.
"""

from __future__ import annotations

import threading
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.connection import parse_url

from scheduler.infra.redis_sentinel import CERT_REQS, async_sentinel_client, is_sentinel_url, sentinel_client

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
                client = redis_from_url(
                    url, socket_timeout=SOCKET_TIMEOUT_SECONDS,
                    socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
                    health_check_interval=HEALTH_CHECK_SECONDS, decode_responses=True,
                )
                _clients[url] = client
    return client


def redis_from_url(url: str, **kwargs: Any) -> redis.Redis:
    """A new client (and pool) for ``url``: ``redis://``, ``rediss://`` and ``unix://`` as
    ``redis.Redis.from_url`` reads them, ``redis+sentinel://`` through its sentinels. For one-off
    tools and tests; a process' long-lived users share :func:`get_redis`."""
    if is_sentinel_url(url):
        return sentinel_client(url, **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def async_redis_from_url(url: str, **kwargs: Any) -> aioredis.Redis:
    """:func:`redis_from_url` for asyncio (create it in the event loop that will use it)."""
    if is_sentinel_url(url):
        return async_sentinel_client(url, **kwargs)
    return aioredis.Redis.from_url(url, **kwargs)




def is_tls_url(url: str) -> bool:
    """Whether ``url`` connects over TLS (``rediss://``)."""
    return url.split("://", 1)[0].lower() == "rediss"


def redis_ssl_options(url: str) -> dict[str, Any] | None:
    """The TLS options of a ``rediss://`` URL as redis-py reads them from its query (``ssl_*``),
    with ``ssl_cert_reqs`` an :mod:`ssl` constant and ``CERT_REQUIRED`` unless the URL says
    otherwise: what Celery's ``broker_use_ssl`` / ``redis_backend_use_ssl`` need so the broker
    verifies the server exactly as :func:`get_redis` does. None for a URL without TLS."""
    if not is_tls_url(url):
        return None
    options = {key: value for key, value in parse_url(url).items() if key.startswith("ssl_")}
    reqs = options.get("ssl_cert_reqs", "required")
    if isinstance(reqs, str):
        if reqs.lower() not in CERT_REQS:
            raise ValueError(f"ssl_cert_reqs={reqs!r} in the Redis URL: use none, optional or required")
        reqs = CERT_REQS[reqs.lower()]
    options["ssl_cert_reqs"] = reqs
    return options
