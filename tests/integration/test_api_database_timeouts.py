"""A database that accepts connections and never answers (issue 16): prompt JSON 503s, no hang.

The fault run saw requests hang up to 130 s and ``/readyz`` hang with them. Here the database URL
points at a black-hole TCP listener on loopback (it listens, the kernel completes the handshake,
nothing ever reads or writes): ``/readyz`` must say 503 within its own deadline and a submit must
fail with the JSON error shape within the connect timeout. The session timeouts are checked on a
real PostgreSQL when one is configured, and a silent Redis gets the same prompt 503 from ``/readyz``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from api.app import create_app
from scheduler.infra.db import DatabaseTimeouts, make_engine
from scheduler.infra.settings import Settings

pytestmark = pytest.mark.integration

JOB = {"kind": "generate", "input": {"prompt": "hello"}, "params": {"max_new_tokens": 4}}


@pytest.fixture
def black_hole_port() -> Iterator[int]:
    """A loopback port that accepts TCP connections (into the backlog) and never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield int(listener.getsockname()[1])


def test_a_silent_database_gives_prompt_json_503s(
    make_settings: Callable[..., Settings], black_hole_port: int
) -> None:
    settings = make_settings(
        database_url=f"postgresql+psycopg://cloverq@127.0.0.1:{black_hole_port}/cloverq",
        auth="disabled", database_connect_timeout_seconds=2.0, readiness_timeout_seconds=1.0,
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        started = time.monotonic()
        ready = client.get("/readyz")
        assert time.monotonic() - started < 1.9  # its own deadline, not the connect timeout
        assert ready.status_code == 503
        body = ready.json()
        assert body["ready"] is False
        assert body["checks"]["database"] == {"ok": False, "detail": "no answer within 1s"}
        assert body["checks"]["redis"]["ok"] is True

        started = time.monotonic()
        submitted = client.post("/v1/jobs", json=JOB)
        assert time.monotonic() - started < 4.5  # connect timeout (2 s) plus slack
        assert submitted.status_code == 503
        assert submitted.headers["content-type"].startswith("application/json")
        assert submitted.json()["error"]["code"] == "unavailable"


def test_a_silent_redis_gives_a_prompt_503_from_readyz(
    make_settings: Callable[..., Settings], black_hole_port: int
) -> None:
    settings = make_settings(redis_url=f"redis://127.0.0.1:{black_hole_port}/0", auth="disabled",
                             readiness_timeout_seconds=1.0)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        started = time.monotonic()
        ready = client.get("/readyz")
        assert time.monotonic() - started < 1.9
    assert ready.status_code == 503
    checks = ready.json()["checks"]
    assert checks["database"]["ok"] is True
    assert checks["redis"] == checks["workers"] == {"ok": False, "detail": "no answer within 1s"}


def test_postgres_sessions_carry_statement_and_lock_timeouts(postgres_url: str) -> None:
    from sqlalchemy.exc import OperationalError

    engine = make_engine(postgres_url, timeouts=DatabaseTimeouts(connect=3, statement=0.2, lock=0.25))
    try:
        with engine.connect() as connection:
            assert connection.scalar(text("SHOW statement_timeout")) == "200ms"
            assert connection.scalar(text("SHOW lock_timeout")) == "250ms"
            with pytest.raises(OperationalError, match="statement timeout"):
                connection.execute(text("SELECT pg_sleep(2)"))
    finally:
        engine.dispose()
