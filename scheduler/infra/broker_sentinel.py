"""The Celery broker behind Redis Sentinel: kombu's Sentinel transport with cloverq's channel.

Selected in ``scheduler.infra.celery_app`` for a ``redis+sentinel://`` URL, which
``scheduler.infra.redis_sentinel.kombu_broker`` turns into kombu's form (``sentinel://`` per
sentinel, ``master_name`` transport option). kombu's ``SentinelChannel`` builds its pools with
redis-py's ``Sentinel.master_for``, so a connection that breaks or meets a demoted master
reconnects to the master the sentinels name. Two things are added, as in
``scheduler.infra.redis_sentinel``, for a coordinated failover whose old master keeps answering
for a while:

- publishing (:meth:`SentinelChannel.conn_or_acquire`) asks the sentinels at most every
  ``FOLLOW_SECONDS`` and drops the pool's idle connections when the master moved;
- consuming: the BRPOP connection lives as long as the channel, so before each BRPOP (one per
  second when idle) :meth:`SentinelChannel._brpop_start` checks the same and, when the master moved,
  raises a connection error: Celery then re-establishes the broker connection (as after a broken
  one), whose new channel connects to the new master. Jobs running meanwhile go on.

TLS (``rediss+sentinel://``): the transport option ``master_tls`` (the URL's ``ssl_*`` options,
``scheduler.infra.redis_sentinel.kombu_broker``) makes the master connections redis-py's
``SentinelManagedSSLConnection`` with those options (:meth:`SentinelChannel._connparams`); the
sentinel connections get them through ``sentinel_kwargs``. Celery's ``broker_use_ssl`` is not used:
kombu's Sentinel transport would apply it to the master only.

Everything else (admission releases in one MULTI, QoS that survives a lost broker) is
``scheduler.infra.broker``'s channel.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from redis.sentinel import SentinelManagedSSLConnection

from scheduler.infra.broker import Channel
from scheduler.infra.redis_sentinel import follow_master, master_moved

SENTINEL_TRANSPORT_PATH = "scheduler.infra.broker_sentinel:Transport"


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """cloverq's channel (``scheduler.infra.broker.Channel``) on kombu's Sentinel pools."""

    from_transport_options = (*kombu_redis.SentinelChannel.from_transport_options, "master_tls")
    master_tls: dict[str, Any] | None = None

    def _connparams(self, asynchronous: bool = False) -> Any:
        """kombu's connection parameters; with ``master_tls``, TLS connections to the master."""
        params = super()._connparams(asynchronous)
        if self.master_tls is None:
            return params
        params.update(self.master_tls)
        connection_class: Any = SentinelManagedSSLConnection
        if asynchronous:  # as kombu does for its own class: the poller forgets a dropped connection
            channel = self

            class Connection(SentinelManagedSSLConnection):
                def disconnect(self, *args: Any, **kwargs: Any) -> None:
                    super().disconnect(*args, **kwargs)
                    if channel._registered:
                        channel._on_connection_disconnect(self)

            connection_class = Connection
        params["connection_class"] = connection_class
        return params

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        if not client:
            follow_master(self.pool)
        with super().conn_or_acquire(client) as acquired:
            yield acquired

    def _brpop_start(self, timeout: Any = None) -> None:
        connection = self.client.connection
        if connection is not None and master_moved(self.async_pool, connection):
            raise redis.ConnectionError(
                f"the Redis master moved (Sentinel) from {connection.host}:{connection.port}: reconnecting")
        super()._brpop_start(timeout)


class Transport(kombu_redis.SentinelTransport):
    """kombu's Sentinel transport with :class:`SentinelChannel`."""

    Channel = SentinelChannel
