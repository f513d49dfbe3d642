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
redelivery of a tick whose beat died mid-run). A failover can lose a claim written just before it,
as it can the ack: there the window is narrowed, not closed (every tick is idempotent anyway).

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


def claim_seconds(expires: str | datetime | None, *, now: datetime) -> int:
    """The claim's TTL: until ``CLAIM_MARGIN_SECONDS`` after the message expires."""
    if expires is None:
        return CLAIM_DEFAULT_SECONDS
    at = datetime.fromisoformat(expires) if isinstance(expires, str) else expires
    if at.tzinfo is None or now.tzinfo is None:
        at, now = at.replace(tzinfo=None), now.replace(tzinfo=None)
    return max(1, int((at - now).total_seconds()) + CLAIM_MARGIN_SECONDS)


def claim_delivery(client: redis.Redis, task: str, message_id: str, *, ttl_seconds: int) -> bool:
    """True for the first claim of ``message_id``; False when it was claimed before."""
    return bool(client.set(redis_keys.tick_claim(task, message_id), "1", nx=True, ex=ttl_seconds))


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
            try:
                first = claim_delivery(tick_redis(), self.name, message_id, ttl_seconds=ttl)
            except (OSError, redis.RedisError) as exc:
                log.warning("tick.claim_failed", task=self.name, message_id=message_id,
                            error=f"{type(exc).__name__}: {exc}")
                raise Ignore() from exc
            if not first:
                log.warning("tick.redelivery_dropped", task=self.name, message_id=message_id)
                raise Ignore()
        return super().__call__(*args, **kwargs)


# The options of every periodic tick's ``shared_task``.
TICK_TASK_OPTIONS: dict[str, Any] = {"ignore_result": True, "acks_late": False, "base": OncePerMessage}
