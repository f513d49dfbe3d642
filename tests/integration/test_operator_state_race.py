"""A drain committed while beat restores the operator state is not undone (issue 32 part 5).

The restore (``scheduler/fleet/operator_state.py`` ``restore_operator_state``) reads Redis, then
SQL, then rewrites Redis when they differ. An operator's drain that commits to SQL and flags Redis
after the restore's SQL read but before its write used to be deleted by that write (the queue
resumed on every worker until the next tick). The write is now a compare-and-set (WATCH, then
MULTI/EXEC): the drain's flag makes it fail, and the restore reads again. The drain is made to
land exactly in that window by running it from inside the restore's SQL read (real Redis, real
database, both backends).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis as redis_lib
from celery import Celery
from sqlalchemy.orm import Session

from scheduler.fleet import operator_state
from scheduler.fleet.queue_drain import drained_queues
from scheduler.infra.db import get_session_factory
from scheduler.infra.redis_keys import DRAINED_SET, LIMITS_KEY

pytestmark = pytest.mark.integration

LIMIT = "tenant_max_active:race"


@pytest.fixture
def client(redis_url: str) -> Iterator[redis_lib.Redis]:
    client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    client.delete(DRAINED_SET, LIMITS_KEY)
    yield client
    client.delete(DRAINED_SET, LIMITS_KEY)


def test_a_drain_between_the_restores_read_and_write_stays(
    fresh_db_url: str, client: redis_lib.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    sessions = get_session_factory(fresh_db_url)
    with sessions() as session:
        operator_state.restore_operator_state(session, client)  # this database's one-off adoption
        operator_state.update_limits(session, client, {LIMIT: 2})
    client.delete(LIMITS_KEY)  # Redis lost the override: the next restore has something to write

    read_sql = operator_state.sql_operator_state
    drains: list[str] = []

    def read_then_operator_drains(session: Session) -> operator_state.OperatorState:
        state = read_sql(session)
        if not drains:  # once: the admin API drains "bulk" right after the restore read SQL
            with sessions() as admin:
                operator_state.set_queue_drained(admin, client, Celery("unused"), "bulk", drained=True,
                                                 destinations=[])
            drains.append("bulk")
        return state

    monkeypatch.setattr(operator_state, "sql_operator_state", read_then_operator_drains)
    with sessions() as session:
        assert operator_state.restore_operator_state(session, client) is True
    assert drains == ["bulk"]
    assert drained_queues(client) == {"bulk"}  # the restore did not write its stale read over it
    assert client.hget(LIMITS_KEY, LIMIT) == "2.0"  # and still restored what Redis had lost
    with sessions() as session:
        assert operator_state.restore_operator_state(session, client) is False  # Redis == SQL
        operator_state.clear_operator_state(session, client)
