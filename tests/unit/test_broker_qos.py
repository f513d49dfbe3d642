"""The broker's QoS never turns a vanished Redis connection into Celery's "unrecoverable error"
(issue 16: workers exited after a Redis restart, from a late ack and from restore_unacked)."""

from __future__ import annotations

from typing import Any

from scheduler.infra.broker import QoS


class _ChannelWithoutConnection:
    """What kombu leaves behind after a broker restart: the channel's connection is None."""

    do_restore = False
    connection = None

    def conn_or_acquire(self, client: Any = None) -> Any:
        raise AttributeError("'NoneType' object has no attribute 'client'")

    def pipe_or_acquire(self, pipe: Any = None, client: Any = None) -> Any:
        return self.conn_or_acquire(client)


def _qos_with(tags: list[str]) -> QoS:
    qos = QoS(_ChannelWithoutConnection())  # type: ignore[no-untyped-call]
    for tag in tags:
        qos._delivered[tag] = {"body": tag}
    return qos


def test_late_ack_and_reject_on_a_dead_connection_are_skipped_and_forgotten() -> None:
    qos = _qos_with(["t1", "t2", "t3"])
    qos.ack("t1")
    qos.reject("t2")
    qos.reject("t3", requeue=True)
    assert not qos._delivered  # the SQL row holds the outcome; a redelivery is dropped at claim


def test_restore_unacked_on_a_dead_connection_is_skipped() -> None:
    qos = _qos_with(["t1"])
    qos.restore_unacked()
    assert not qos._delivered
