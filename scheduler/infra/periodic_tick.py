"""The Celery options of beat's periodic ticks, and the checks that run each tick message once.

Ticks are acked on receipt, not late (see ``scheduler.maintenance.tasks``): every tick is
idempotent and the next one replaces a lost one. Yet a tick message can arrive twice:

- a beat that closes its broker channel (a SIGTERM at a leader hand-over, a Redis failover) hands
  back every delivery it has not acked yet, and a pool thread can accept one of those in the same
  instant: the tick runs here and, handed back, once more on the other beat while its ``expires``
  has not passed (CI saw it once: ``reconcile`` run twice at a beat hand-over);
- a Sentinel failover promotes the replica while the old master answers on for seconds: a tick
  popped from the old master is popped again from the promoted replica, which never saw the pop
  (CI saw it twice: ``release-delayed``, then ``expire``, run twice in the short fleet run).

So the tick's first act is to claim its message id in SQL (``scheduler/infra/tick_claims.py``:
one row, primary key the id, until a little after the message expires, when Celery would discard
a redelivery anyway); a second delivery of a claimed id is dropped with Celery's ``Ignore``
(logged ``tick.redelivery_dropped`` and ``Task NAME[id] ignored``, not run). The claim lived in
Redis until the failover above lost one with the old master's writes; the system of record keeps
it through any Redis fault. A tick whose claim cannot reach the database is dropped too: at most
once, and the next period's tick replaces it (so is the redelivery of a tick whose beat died
mid-run).

A leader that hangs between deciding a dispatch and sending it (a GC pause, SIGSTOP, a stuck
thread) sends the tick when it resumes, after a standby has taken the lease over and dispatched
everything itself (CI saw it once: the hung leader of ``test_beat_standby.py`` sent a tick on
resuming). No check in the sender can close that gap, so the receiver does, with the lease's
fencing number: the beat stamps each tick with the fence it led under (header
``BEAT_FENCE_HEADER``, ``scheduler/maintenance/beat_scheduler.py``), and a tick whose fence is
below the fencing counter in Redis (a later leadership began) is dropped
(``tick.stale_leader_dropped``; a counter that cannot be read drops it too,
``tick.fence_check_failed``): a newer leader from another process dispatches every entry when it
takes over, and otherwise the entry's next period replaces it. A tick without the header (sent by
hand, an older beat) is not checked.

A tick called as a plain function (no message id: tests, a shell) runs without a claim.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, NoReturn

import redis
import structlog
from celery import Task
from celery.exceptions import Ignore
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from scheduler.infra import redis_keys, tick_claims
from scheduler.infra.db import get_session_factory
from scheduler.infra.redis_client import get_redis
from scheduler.infra.settings import get_settings

log = structlog.get_logger(__name__)

# How long a claim outlives its message's ``expires`` (clocks of the beats' hosts may differ), and
# its lifetime when the message carries no ``expires``.
CLAIM_MARGIN_SECONDS = 60
CLAIM_DEFAULT_SECONDS = 3600
# The message header that carries the fencing number of the beat leadership that sent a tick.
BEAT_FENCE_HEADER = "cloverq_beat_fence"


def claim_seconds(expires: str | datetime | None, *, now: datetime) -> int:
    """The claim's lifetime: until ``CLAIM_MARGIN_SECONDS`` after the message expires."""
    if expires is None:
        return CLAIM_DEFAULT_SECONDS
    at = datetime.fromisoformat(expires) if isinstance(expires, str) else expires
    if at.tzinfo is None or now.tzinfo is None:
        at, now = at.replace(tzinfo=None), now.replace(tzinfo=None)
    return max(1, int((at - now).total_seconds()) + CLAIM_MARGIN_SECONDS)


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


def tick_session() -> Session:
    """A session on the process's database (a seam for tests that point a tick at their own)."""
    return get_session_factory(get_settings().resolved_database_url)()


class OncePerMessage(Task):
    """A Celery task that runs each of its messages at most once (see the module docstring)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        message_id = request.id
        if message_id is not None and not request.called_directly:
            self._admit(request, message_id)
        return super().__call__(*args, **kwargs)

    def _admit(self, request: Any, message_id: str) -> None:
        """Return when this delivery may run; raise ``Ignore`` (the tick is dropped) otherwise."""
        fence = sent_under_fence(request)
        try:
            if fence is not None and superseded(tick_redis(), fence):
                log.warning("tick.stale_leader_dropped", task=self.name, message_id=message_id, fence=fence)
                raise Ignore()
        except (OSError, redis.RedisError) as exc:
            self._unchecked("tick.fence_check_failed", message_id, exc)
        now = datetime.now().astimezone()
        expires_at = now + timedelta(seconds=claim_seconds(request.expires, now=now))
        try:
            with tick_session() as session:
                first = tick_claims.claim(session, task=self.name, message_id=message_id,
                                          expires_at=expires_at)
        except (OSError, SQLAlchemyError) as exc:
            self._unchecked("tick.claim_failed", message_id, exc)
        if not first:
            log.warning("tick.redelivery_dropped", task=self.name, message_id=message_id)
            raise Ignore()

    def _unchecked(self, event: str, message_id: str, exc: BaseException) -> NoReturn:
        """A check that could not be made drops the tick (at most once; the next period's replaces it)."""
        log.warning(event, task=self.name, message_id=message_id, error=f"{type(exc).__name__}: {exc}")
        raise Ignore() from exc


# The options of every periodic tick's ``shared_task``.
TICK_TASK_OPTIONS: dict[str, Any] = {"ignore_result": True, "acks_late": False, "base": OncePerMessage}
