"""The ``tick_claims`` table: one row per periodic tick message that ran, so a second delivery of
it is dropped (``scheduler/infra/periodic_tick.py`` says when a tick arrives twice).

Why SQL and not Redis (where the claim lived before): the tick's second delivery comes from Redis
itself at a failover. ``SENTINEL FAILOVER`` promotes the replica while the old master answers on
for seconds with no replica left; a tick popped from the old master, claimed there and run, is
popped again from the promoted replica (which never saw the first pop), and the claim is lost
with the old master's writes (CI saw it twice: ``release-delayed``, then ``expire``, run twice in the
short fleet run, the second time behind a ``WAIT`` for the replica on the Redis claim). The
system of record keeps a claim through any Redis fault; a tick is about one row a second.

A row lives until a minute after its message expires (when Celery would discard a redelivery
anyway); the purge tick deletes older rows (:func:`purge_expired`): a few hundred rows with the
default intervals. On the embedded default's SQLite a claim takes the write lock for one short
statement beside the API's and the workers' writes; one that waits past the busy timeout drops its
tick, which the next period replaces.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Index, String, delete
from sqlalchemy.orm import Mapped, Session, mapped_column

from scheduler.infra.db import dialect_insert, rowcount
from scheduler.jobs.models import Base, UTCDateTime


class TickClaim(Base):
    """A tick message that ran (or is running). Schema: ``0017_tick_claims``."""

    __tablename__ = "tick_claims"
    __table_args__ = (Index("ix_tick_claims_expires_at", "expires_at"),)

    message_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    task: Mapped[str] = mapped_column(String(128), nullable=False)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False)


def claim(session: Session, *, task: str, message_id: str, expires_at: datetime) -> bool:
    """Insert the claim of ``message_id`` and commit; True when this call made it (the first
    delivery), False when it was there already. One statement, no read first: two deliveries
    claiming at once cannot both win (the primary key)."""
    values = {"message_id": message_id, "task": task, "expires_at": expires_at}
    statement = (dialect_insert(session)(TickClaim).values(**values)
                 .on_conflict_do_nothing().returning(TickClaim.message_id))
    made = session.execute(statement).scalar_one_or_none()  # rowcount: -1 on psycopg for this INSERT
    session.commit()
    return made is not None


def purge_expired(session: Session, *, now: datetime) -> int:
    """Delete the claims whose messages expired more than their margin ago; returns how many."""
    gone = rowcount(session.execute(delete(TickClaim).where(TickClaim.expires_at < now)))
    session.commit()
    return gone
