"""kombu's Redis transport with one publishing client per channel instead of one per message.

kombu's Redis channel builds a new ``redis.Redis`` object for every publish
(``Channel.conn_or_acquire`` -> ``_create_client``); building one copies its ~170 response
callbacks, about 50 us of CPU, which is a measurable share of the API's submit path (the
message itself costs about as much to send). A ``redis.Redis`` over a ``ConnectionPool`` holds
no connection of its own and is safe to share between threads, so one per channel serves every
command that kombu would have sent through a fresh one (redis-py reconnects inside the pool after
a connection error). It is rebuilt whenever the channel's pool is a new one (kombu drops its pools
after a fork and on close), so it never outlives the pool it was made for.

Selected in ``scheduler.celery_app`` through Celery's ``broker_transport`` for ``redis://``
URLs; everything else about the transport (priority lists, visibility timeout, BRPOP) is
kombu's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kombu.transport import redis as kombu_redis

TRANSPORT_PATH = "scheduler.broker:Transport"


class Channel(kombu_redis.Channel):  # type: ignore[misc]
    """kombu's Redis channel, reusing one synchronous client for its short commands."""

    _shared_client: Any = None

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        shared = self._shared_client
        pool = self.pool  # created by kombu on first use, again after it dropped the old one
        if shared is None or shared.connection_pool is not pool:
            shared = self._create_client()
            self._shared_client = shared
        yield shared


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel
