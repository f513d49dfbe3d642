"""kombu's Redis transport with one publishing client per channel instead of one per message.

kombu's Redis channel builds a new ``redis.Redis`` object for every publish
(``Channel.conn_or_acquire`` -> ``_create_client``); building one copies its ~170 response
callbacks, about 50 us of CPU, which is a measurable share of the API's submit path (the
message itself costs about as much to send). A ``redis.Redis`` over a ``ConnectionPool`` holds
no connection of its own and is safe to share between threads, so one per channel serves every
command that kombu would have sent through a fresh one (redis-py reconnects inside the pool after
a connection error). It is rebuilt whenever the channel's pool is a new one (kombu drops its pools
after a fork and on close), so it never outlives the pool it was made for.

It also releases a job's admission reservations (``scheduler.access.admission``) atomically with the
job's message: a message carrying ``ADMITTED_HEADER`` is pushed in one MULTI with the ZREMs of
its reservations, so the job is counted once, first as a reservation, then in the list.

Selected in ``scheduler.infra.celery_app`` through Celery's ``broker_transport`` for ``redis://``
and ``rediss://`` URLs (TLS comes from ``broker_use_ssl``, which the app sets from the URL's
query), and through ``scheduler.infra.broker_sentinel`` for ``redis+sentinel://``; everything else
about the transport (priority lists, visibility timeout, BRPOP) is kombu's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
import structlog
from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps

from scheduler.infra import redis_keys

log = structlog.get_logger(__name__)

TRANSPORT_PATH = "scheduler.infra.broker:Transport"

# Message header: [queue reservations key, tenant reservations key, member] of an admitted job.
ADMITTED_HEADER = "cloverq_admitted"


def admitted_headers(*, queue: str, tenant: str, job_id: object) -> dict[str, list[str]]:
    """Headers that make the message of an admitted job release its admission reservations."""
    return {ADMITTED_HEADER: [redis_keys.queue_reservations(queue), redis_keys.tenant_reservations(tenant),
                              redis_keys.enqueued(job_id)]}


# Transports whose channel is :class:`Channel` (this one, and its Sentinel twin in broker_sentinel).
RELEASING_TRANSPORTS = (TRANSPORT_PATH, "scheduler.infra.broker_sentinel:Transport")


def releases_reservations(app: Any) -> bool:
    """Whether ``app`` publishes through :class:`Channel` (else a publisher releases itself)."""
    return getattr(app.conf, "broker_transport", None) in RELEASING_TRANSPORTS


class QoS(kombu_redis.QoS):
    """kombu's QoS, except that handing back this channel's unacked deliveries when the broker is
    gone never kills the process.

    On a broker restart kombu closes the channel and restores its unacked deliveries through a
    connection that no longer exists; redis-py then raises (``ConnectionError``, or an
    ``AttributeError`` on the vanished connection's ``hostname``), which Celery treats as
    unrecoverable: the worker or beat exited with code 0 and nothing restarted it (issue 16).
    Skipping the restore loses nothing: a delivery left in Redis's unacked set is restored by
    kombu's visibility sweep, and one Redis lost is republished from SQL by the reconciler.

    The same holds for the ack (or reject) of a task that finished while the broker was away:
    kombu acks on the channel the message came from, whose connection is gone, and the
    ``AttributeError`` on ``connection.client`` was the second unrecoverable error of issue 16.
    The job's outcome is already in SQL; a redelivery of the unacked message (the visibility
    sweep, when Redis kept it) finds the job final and is dropped at claim.
    """

    def ack(self, delivery_tag: Any) -> None:
        try:
            super().ack(delivery_tag)
        except (AttributeError, OSError, redis.RedisError) as exc:
            self._skip_settled(delivery_tag, "ack", exc)

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        try:
            super().reject(delivery_tag, requeue=requeue)
        except (AttributeError, OSError, redis.RedisError) as exc:
            self._skip_settled(delivery_tag, "reject", exc)

    def _skip_settled(self, delivery_tag: Any, action: str, exc: BaseException) -> None:
        """Forget a delivery whose ack/reject could not reach the broker (see the class docstring)."""
        log.warning("broker.settle_skipped", action=action, error=f"{type(exc).__name__}: {exc}")
        self._delivered.pop(delivery_tag, None)

    def restore_unacked(self, client: Any = None) -> None:
        try:
            super().restore_unacked(client)
        except (AttributeError, OSError, redis.RedisError) as exc:
            log.warning("broker.restore_unacked_skipped", error=f"{type(exc).__name__}: {exc}",
                        deliveries=len(self._delivered))
            self._delivered.clear()


class Channel(kombu_redis.Channel):
    """kombu's Redis channel, reusing one synchronous client for its short commands."""

    QoS = QoS

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

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        """kombu's ``_put``; an admitted job's message goes in one MULTI with its releases."""
        admitted = (message.get("headers") or {}).get(ADMITTED_HEADER)
        kombus_own = kwargs.get("_publish_batch") is not None or (self._expires and queue in self._expires)
        if not admitted or kombus_own:
            super()._put(queue, message, **kwargs)
            if admitted:  # kombu's own path: released right after (the job counts twice a moment)
                with self.conn_or_acquire() as client:
                    _release(client.pipeline(transaction=False), admitted).execute()
            return
        key = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
        with self.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=True)
            pipe.lpush(key, dumps(message))
            _release(pipe, admitted).execute()


def _release(pipe: Any, admitted: list[str]) -> Any:
    queue_key, tenant_key, member = admitted
    pipe.zrem(queue_key, member)
    pipe.zrem(tenant_key, member)
    return pipe


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel
