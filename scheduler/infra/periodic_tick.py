"""The Celery options of beat's periodic ticks, and the claim that runs each tick message once.

Ticks are acked on receipt, not late (see ``scheduler.maintenance.tasks``): every tick is
idempotent and the next one replaces a lost one. But "on receipt" is when a pool thread accepts
the message, and a beat that closes its broker channel (a SIGTERM at a leader hand-over, a Redis
failover) hands back every delivery it has not acked yet. A thread can accept one of those in the
same instant: the tick runs here and, handed back, once more on the other beat while its
``expires`` has not passed (CI saw it once: ``reconcile`` run twice at a beat hand-over). So the
tick's first act is to claim its message id in Redis (``SET NX`` until a little after the message
expires, when Celery would discard a redelivery anyway); a second delivery of a claimed id is
dropped with Celery's ``Ignore`` (logged ``Task NAME[id] ignored``, not run). A tick whose claim
cannot reach Redis is dropped too: at most once, and the next period's tick replaces it (so is the
redelivery of a tick whose beat died mid-run).

A failover loses what the old master had not yet sent to its replica: the ack and the claim alike.
The redelivered tick then finds no claim on the promoted replica and runs twice (CI saw it once:
``release-delayed`` at a sentinel failover). So where the master has replicas, a claim counts only
once one of them holds it (``WAIT``, ``CLAIM_REPLICA_WAIT_MS``); a claim no replica confirmed in
time is dropped like one that could not reach Redis. With several replicas the window is narrowed
to a promotion of one that missed the claim, not closed (every tick is idempotent anyway). A server
that refuses ``INFO`` or ``WAIT`` to this client gets the claim as before, unconfirmed: periodic
work must not stop for a command a managed Redis may withhold.

A leader that hangs between deciding a dispatch and sending it (a GC pause, SIGSTOP, a stuck
thread) sends the tick when it resumes, after a standby has taken the lease over and dispatched
everything itself (CI saw it once: the hung leader of ``test_beat_standby.py`` sent a tick on
resuming). No check in the sender can close that gap, so the receiver does, with the lease's
fencing number: the beat stamps each tick with the fence it led under (header
``BEAT_FENCE_HEADER``, ``scheduler/maintenance/beat_scheduler.py``), and a tick whose fence is
below the fencing counter (a later leadership began) is dropped (``tick.stale_leader_dropped``):
the newer leader dispatches every entry when it takes over, so nothing is skipped. A tick without
the header (sent by hand, an older beat) is not checked.

A tick called as a plain function (no message id: tests, a shell) runs without a claim.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import redis
import structlog
from celery import Task
from celery.exceptions import Ignore

from scheduler.infra import redis_keys
from scheduler.infra.redis_client import get_redis
from scheduler.infra.settings import get_settings

log = structlog.get_logger(__name__)

# How long a claim outlives its message's ``expires`` (clocks of the beats' hosts may differ), and
# its lifetime when the message carries no ``expires``.
CLAIM_MARGIN_SECONDS = 60
CLAIM_DEFAULT_SECONDS = 3600
# How long a claim waits for a replica to confirm it (a master with replicas: sentinel deployments);
# a tick runs every second or more, and one dropped is replaced by the next.
CLAIM_REPLICA_WAIT_MS = 500
# The message header that carries the fencing number of the beat leadership that sent a tick.
BEAT_FENCE_HEADER = "cloverq_beat_fence"


def claim_seconds(expires: str | datetime | None, *, now: datetime) -> int:
    """The claim's TTL: until ``CLAIM_MARGIN_SECONDS`` after the message expires."""
    if expires is None:
        return CLAIM_DEFAULT_SECONDS
    at = datetime.fromisoformat(expires) if isinstance(expires, str) else expires
    if at.tzinfo is None or now.tzinfo is None:
        at, now = at.replace(tzinfo=None), now.replace(tzinfo=None)
    return max(1, int((at - now).total_seconds()) + CLAIM_MARGIN_SECONDS)


def claim_delivery(
    client: redis.Redis, task: str, message_id: str, *, ttl_seconds: int, wait_ms: int = CLAIM_REPLICA_WAIT_MS
) -> tuple[bool, bool]:
    """(first, durable): whether this is the first claim of ``message_id``, and whether it would
    outlive a failover: always where the master has no replica connected (nothing a failover could
    promote), else whether a replica confirmed it within ``wait_ms`` (``WAIT`` counts the writes
    of its own connection, so the claim and the wait go down one pipeline)."""
    key = redis_keys.tick_claim(task, message_id)
    try:
        replicas = int(client.info("replication").get("connected_slaves", 0))
    except redis.ResponseError:  # INFO not granted to this user: the claim as before, unconfirmed
        replicas = 0
    if replicas == 0:
        first = bool(client.set(key, "1", nx=True, ex=ttl_seconds))
        return first, first
    with client.pipeline(transaction=False) as pipe:
        pipe.set(key, "1", nx=True, ex=ttl_seconds)
        pipe.wait(1, wait_ms)
        claimed, confirmed = pipe.execute(raise_on_error=False)
    if isinstance(claimed, Exception):
        raise claimed
    if isinstance(confirmed, redis.ResponseError):  # WAIT refused (renamed away): the claim as before
        return bool(claimed), bool(claimed)
    return bool(claimed), bool(claimed) and int(confirmed) >= 1


def superseded(client: redis.Redis, fence: int) -> bool:
    """Whether a leadership later than ``fence`` began (the fencing counter moved past it). A counter
    that is missing or lower (a Redis that restarted empty counts from 1 again) supersedes nothing."""
    counter = client.get(redis_keys.BEAT_FENCE_KEY)
    return counter is not None and int(counter) > fence


def sent_under_fence(request: Any) -> int | None:
    """The fence a tick's message carries, or None. A worker's request holds the message headers as
    attributes; ``Task.apply(headers=...)`` (tests) nests them under ``headers``."""
    value = request.get(BEAT_FENCE_HEADER)
    if value is None:
        value = (request.get("headers") or {}).get(BEAT_FENCE_HEADER)
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):  # not one of ours: unchecked, like a tick without the header
        return None


def tick_redis() -> redis.Redis:
    """The process's Redis client (a seam for tests that point a tick at their own Redis)."""
    return get_redis(get_settings().resolved_redis_url)


class OncePerMessage(Task):
    """A Celery task that runs each of its messages at most once (see the module docstring)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        message_id = request.id
        if message_id is not None and not request.called_directly:
            ttl = claim_seconds(request.expires, now=datetime.now().astimezone())
            fence = sent_under_fence(request)
            try:
                client = tick_redis()
                stale = fence is not None and superseded(client, fence)
                first, durable = (False, False) if stale else claim_delivery(
                    client, self.name, message_id, ttl_seconds=ttl)
            except (OSError, redis.RedisError) as exc:
                log.warning("tick.claim_failed", task=self.name, message_id=message_id,
                            error=f"{type(exc).__name__}: {exc}")
                raise Ignore() from exc
            if stale:
                log.warning("tick.stale_leader_dropped", task=self.name, message_id=message_id, fence=fence)
                raise Ignore()
            if not first:
                log.warning("tick.redelivery_dropped", task=self.name, message_id=message_id)
                raise Ignore()
            if not durable:
                log.warning("tick.claim_unreplicated", task=self.name, message_id=message_id)
                raise Ignore()
        return super().__call__(*args, **kwargs)


# The options of every periodic tick's ``shared_task``.
TICK_TASK_OPTIONS: dict[str, Any] = {"ignore_result": True, "acks_late": False, "base": OncePerMessage}
