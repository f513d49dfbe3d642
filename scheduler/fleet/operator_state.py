"""Operator state: runtime decisions of an operator, kept in SQL and mirrored to Redis.

What it covers (everything the admin API or the ``cloverq`` CLI sets that admission or the
workers read from Redis):

- queue drain flags: ``scheduler.infra.redis_keys.DRAINED_SET``, read by every worker: its
  ``worker/queue_drain.py`` ``DrainFollower`` reads them and feeds its ``worker/consumers.py``
  ``ConsumerController``, which keeps the drained queues unconsumed;
- runtime limits: ``scheduler.infra.redis_keys.LIMITS_KEY`` (global and per-key rate limits, the
  default and per-tenant active-job caps, per-queue depth caps), read by the admission scripts;
- key revocations: ``scheduler.infra.redis_keys.REVOKED_SET``. Their record already is the ``api_keys``
  row (``revoked``); the Redis set is only how every API process learns at once, so it is
  restored from those rows, not stored twice.

Why: Redis restarts empty (or from a snapshot older than the last change), and a drain that
silently resumes, or a tenant cap that silently reverts to the default, is an outage or a
noisy neighbour. So SQL (the ``operator_state`` table, migration ``0008_operator_state``; one
row per drained queue, ``kind='drain'``, and per limit override, ``kind='limit'``, named like
its ``LIMITS_KEY`` field) is the system of record and Redis the fast path:

- every change is **committed to SQL first**, then written to Redis (:func:`set_queue_drained`,
  :func:`update_limits`). When the Redis write fails, the call fails (the
  operator retries) and SQL is ahead of Redis until the next restore heals it, never behind;
- :func:`restore_operator_state` makes Redis equal SQL: it WATCHes the three Redis keys, reads
  them, then SQL, and only when they differ rewrites the keys in one MULTI/EXEC (readers never
  see half). Beat runs it on every reconcile tick (``scheduler/maintenance/tasks.py``
  ``reconcile_task``: two small SELECTs and one pipelined Redis read when nothing changed), the
  API once at start-up. The write is a compare-and-set: every change writes Redis *after* its
  SQL commit, so a change the restore's SQL read missed (committed after that read) writes Redis
  after the WATCH, and the EXEC is refused; the restore reads both sides again and retries
  (:data:`RESTORE_ATTEMPTS`). A change whose Redis write came before the WATCH committed before
  the SQL read, so the restore writes its value. Either way a drain committed between the
  restore's read and its write is never undone (issue 32: without the WATCH, the restore wrote
  the SQL state it had read, deleting a flag set a moment later, until the next tick).

Upgrades: migration ``0008_operator_state`` inserts the row ``('meta', 'adopt_redis')``. The
first restore after it imports what Redis holds then into SQL (deleting the row in the same
transaction, so exactly one process imports) instead of overwriting it: a queue drained before
the upgrade stays drained.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import redis
import structlog
from celery import Celery
from sqlalchemy import Float, String, delete, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Mapped, Session, mapped_column

from scheduler.access.api_keys import ApiKey
from scheduler.access.limit_overrides import validate_limit_field, write_limit_overrides
from scheduler.fleet import queue_drain
from scheduler.infra.db import dialect_insert, rowcount
from scheduler.infra.redis_keys import DRAINED_SET, LIMITS_KEY, REVOKED_SET
from scheduler.jobs.models import Base, UTCDateTime, utcnow

log = structlog.get_logger(__name__)

KIND_DRAIN = "drain"  # name: a queue; value: NULL
KIND_LIMIT = "limit"  # name: a LIMITS_KEY field ("tenant_max_active:acme"); value: the number
KIND_META = "meta"  # bookkeeping rows, see ADOPT_REDIS
ADOPT_REDIS = "adopt_redis"  # present until the first restore imported pre-0008 Redis state


class OperatorSetting(Base):
    """One operator decision (a drained queue or a limit override). Schema: ``0008_operator_state``."""

    __tablename__ = "operator_state"

    kind: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    value: Mapped[float | None] = mapped_column(Float, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)


@dataclass(frozen=True, slots=True)
class OperatorState:
    """The operator state as one side (SQL or Redis) holds it; equal sides need no restore."""

    drained: frozenset[str] = frozenset()
    limits: Mapping[str, float] = field(default_factory=dict)
    revoked: frozenset[str] = frozenset()


# --- changes: SQL first, then Redis --------------------------------------------------------------


def set_queue_drained(
    session: Session, client: redis.Redis, app: Celery, queue: str, *, drained: bool,
    destinations: Iterable[str], timeout: float = 1.0,
) -> list[str]:
    """Drain (``drained``) or resume ``queue``: record it in SQL (a drain row, or none), then set or
    clear its flag and tell ``destinations`` (``scheduler.fleet.queue_drain``); returns the nodes
    that answered."""
    if drained:
        _upsert(session, [(KIND_DRAIN, queue, None)])
    else:
        session.execute(delete(OperatorSetting).where(OperatorSetting.kind == KIND_DRAIN,
                                                      OperatorSetting.name == queue))
    session.commit()
    return queue_drain.set_drained_flag(client, app, queue, drained=drained, destinations=destinations,
                                        timeout=timeout)


def update_limits(session: Session, client: redis.Redis, updates: Mapping[str, float | None]) -> None:
    """Set (number) or clear (None) limit overrides in SQL, then in ``LIMITS_KEY``
    (``limit_overrides.write_limit_overrides``).

    Unknown fields raise ValueError before anything is written."""
    for name in updates:
        validate_limit_field(name)
    cleared = [name for name, value in updates.items() if value is None]
    if cleared:
        session.execute(delete(OperatorSetting).where(OperatorSetting.kind == KIND_LIMIT,
                                                      OperatorSetting.name.in_(cleared)))
    _upsert(session, [(KIND_LIMIT, name, float(value))
                      for name, value in updates.items() if value is not None])
    session.commit()
    write_limit_overrides(client, updates)


def clear_operator_state(session: Session, client: redis.Redis) -> None:
    """Resume every queue and drop every limit override, in SQL and Redis (tests; a reset).
    Revocations stay: they belong to the key rows."""
    session.execute(delete(OperatorSetting).where(OperatorSetting.kind.in_((KIND_DRAIN, KIND_LIMIT))))
    session.commit()
    client.delete(DRAINED_SET, LIMITS_KEY)


# --- reading both sides --------------------------------------------------------------------------


def sql_operator_state(session: Session) -> OperatorState:
    """What SQL says is in force (the system of record)."""
    rows = session.execute(
        select(OperatorSetting.kind, OperatorSetting.name, OperatorSetting.value)
        .where(OperatorSetting.kind.in_((KIND_DRAIN, KIND_LIMIT)))
    ).all()
    revoked = session.scalars(select(ApiKey.key_id).where(ApiKey.revoked.is_(True))).all()
    return OperatorState(
        drained=frozenset(row.name for row in rows if row.kind == KIND_DRAIN),
        limits={row.name: float(row.value) for row in rows
                if row.kind == KIND_LIMIT and row.value is not None},
        revoked=frozenset(revoked),
    )


def redis_operator_state(client: redis.Redis) -> OperatorState:
    """What Redis holds now (one pipelined round trip)."""
    pipe = client.pipeline(transaction=False)
    pipe.smembers(DRAINED_SET)
    pipe.hgetall(LIMITS_KEY)
    pipe.smembers(REVOKED_SET)
    drained, limits, revoked = pipe.execute()
    return OperatorState(
        drained=frozenset(_text(name) for name in drained),
        limits={_text(name): _float(value) for name, value in limits.items()},
        revoked=frozenset(_text(key_id) for key_id in revoked),
    )


# --- restore --------------------------------------------------------------------------------------


RESTORE_ATTEMPTS = 5  # refused EXECs (an operator change in between) before a tick gives up


def restore_operator_state(session: Session, client: redis.Redis) -> bool:
    """Make Redis hold exactly the operator state of SQL; returns whether it had to write.

    Idempotent and cheap when nothing changed. The write only happens if none of the three keys
    changed since they were read (WATCH, then MULTI/EXEC; see the module docstring for why that
    keeps every concurrent change); a refused write reads both sides again. After
    :data:`RESTORE_ATTEMPTS` refusals (changes arriving faster than a restore's round trip) it
    gives up with a warning and returns False: each of those changes wrote Redis itself, and the
    next tick compares again. Raises ``redis.RedisError`` / ``SQLAlchemyError``;
    :func:`restore_quietly` is the variant for callers that must go on regardless."""
    for _ in range(RESTORE_ATTEMPTS):
        with client.pipeline(transaction=True) as pipe:
            pipe.watch(DRAINED_SET, LIMITS_KEY, REVOKED_SET)  # before both reads
            in_redis = redis_operator_state(client)
            _adopt(session, in_redis)
            session.commit()  # no write transaction (SQLite: the database lock) held while reading on
            wanted = sql_operator_state(session)
            session.commit()  # end the read transaction (no snapshot held across ticks)
            if wanted == in_redis:
                return False
            pipe.multi()
            _write_state(pipe, wanted)
            try:
                pipe.execute()
            except redis.WatchError:
                continue  # a change wrote Redis after our reads: read both sides again
        _log_restored(wanted, in_redis)
        return True
    log.warning("operator_state.restore_contended", attempts=RESTORE_ATTEMPTS)
    return False


def _write_state(pipe: Any, wanted: OperatorState) -> None:
    """Queue the rewrite of the three keys to ``wanted`` on a MULTI pipeline."""
    pipe.delete(DRAINED_SET, LIMITS_KEY, REVOKED_SET)
    if wanted.drained:
        pipe.sadd(DRAINED_SET, *sorted(wanted.drained))
    if wanted.limits:
        pipe.hset(LIMITS_KEY, mapping={name: repr(value) for name, value in sorted(wanted.limits.items())})
    if wanted.revoked:
        pipe.sadd(REVOKED_SET, *sorted(wanted.revoked))


def _log_restored(wanted: OperatorState, in_redis: OperatorState) -> None:
    log.warning(
        "operator_state.restored",
        drained=sorted(wanted.drained), limits=len(wanted.limits), revoked=len(wanted.revoked),
        redis_had={"drained": sorted(in_redis.drained), "limits": len(in_redis.limits),
                   "revoked": len(in_redis.revoked)},
    )


def restore_quietly(session: Session, client: redis.Redis, *, where: str) -> bool:
    """:func:`restore_operator_state`, logging a failure instead of raising: an unreachable
    Redis or database must not stop the API from starting or beat from reconciling (the next
    tick retries)."""
    try:
        return restore_operator_state(session, client)
    except (redis.RedisError, SQLAlchemyError) as exc:
        with suppress(SQLAlchemyError):  # a dead connection may refuse the rollback too
            session.rollback()
        log.warning("operator_state.restore_failed", where=where, error=type(exc).__name__)
        return False


def _adopt(session: Session, in_redis: OperatorState) -> None:
    """Import pre-0008 Redis state once (the ``adopt_redis`` row), so an upgrade never resumes
    a drained queue or drops a cap. The DELETE's rowcount decides which process imports."""
    gone = session.execute(delete(OperatorSetting).where(OperatorSetting.kind == KIND_META,
                                                         OperatorSetting.name == ADOPT_REDIS))
    if not rowcount(gone):
        return
    limits: list[tuple[str, str, float | None]] = []
    for name, value in in_redis.limits.items():
        try:
            validate_limit_field(name)
        except ValueError:
            continue  # nothing reads it; not worth keeping
        limits.append((KIND_LIMIT, name, value))
    _upsert(session, [(KIND_DRAIN, queue, None) for queue in in_redis.drained] + limits)
    session.commit()
    log.info("operator_state.adopted", drained=sorted(in_redis.drained), limits=len(limits))


def _upsert(session: Session, rows: list[tuple[str, str, float | None]]) -> None:
    """Insert or overwrite rows (``ON CONFLICT DO UPDATE``: both backends have it), so two API
    processes setting the same override never fail on the primary key."""
    if not rows:
        return
    now = utcnow()
    values: list[dict[str, Any]] = [
        {"kind": kind, "name": name, "value": value, "updated_at": now} for kind, name, value in rows
    ]
    stmt = dialect_insert(session)(OperatorSetting).values(values)
    session.execute(stmt.on_conflict_do_update(
        index_elements=["kind", "name"],
        set_={"value": stmt.excluded.value, "updated_at": stmt.excluded.updated_at},
    ))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _float(value: bytes | str) -> float:
    try:
        return float(_text(value))
    except ValueError:
        return float("nan")  # never equal: a garbled field makes the restore rewrite it
