"""TLS to Redis and PostgreSQL on real servers started by the test (tests/tls_servers.py), with
certificates made by the test (tests/tls_certs.py).

- Redis: a ``redis-server`` listening on a TLS port only: the process' sync client
  (``get_redis``), the API's asyncio client (``api/job_follow.py``) and the Celery broker (publish
  and consume, through cloverq's own kombu transport) all connect over ``rediss://`` with the CA
  from the URL; a client trusting another CA, and a server with an expired certificate, are
  refused, and the start-up check says so in one line.
- PostgreSQL: a cluster with ``ssl=on`` that accepts TCP over TLS only: ``make_engine`` and the
  Alembic migrations with ``sslmode=verify-full``; the wrong CA and an expired certificate
  refused in one line (the reason read by the check's own handshake: libpq gives none).
- ``cloverq worker`` and ``cloverq beat`` exit 78 with that one line, the Redis URL read from a
  ``CLOVERQ_REDIS_URL_FILE`` file.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import create_engine, text

from scheduler.infra.settings import CONFIG_ERROR_EXIT_CODE, Settings
from scheduler.infra.tls_check import check_postgres_tls, check_redis_tls, check_tls
from tests.tls_servers import TlsPostgres, TlsRedis, free_port, tls_postgres_server, tls_redis_server

pytestmark = pytest.mark.integration
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def expired_redis(pki: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    """A TLS redis-server whose certificate (signed by the right CA) has expired."""
    with tls_redis_server(tmp_path_factory.mktemp("expired-redis"), cert=pki.expired_server_cert,
                          key=pki.expired_server_key, ca_cert=pki.ca_cert) as server:
        yield server


# --- Redis --------------------------------------------------------------------------------------


def test_every_redis_client_works_over_tls(tls_redis: TlsRedis) -> None:
    from api.job_follow import stream_redis
    from scheduler.infra.celery_app import RUN_JOB_TASK, create_celery_app
    from scheduler.infra.redis_client import get_redis

    url = tls_redis.url(db=3)
    client = get_redis(url)
    assert isinstance(client.connection_pool.get_connection(), redis_lib.SSLConnection)
    client.set("tls-probe", "yes")
    assert client.get("tls-probe") == "yes"

    app = SimpleNamespace(state=SimpleNamespace(settings=Settings(redis_url=url)))

    async def follow() -> Any:
        aclient = stream_redis(app)  # type: ignore[arg-type]
        try:
            return await aclient.get("tls-probe")
        finally:
            await aclient.aclose()

    assert asyncio.run(follow()) == "yes"

    celery = create_celery_app(Settings(redis_url=url))
    assert celery.conf.broker_use_ssl["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    job_id = str(uuid.uuid4())
    celery.send_task(RUN_JOB_TASK, args=[job_id], queue="standard")
    with celery.connection_for_read() as conn:
        queue = conn.SimpleQueue("standard")
        try:
            message = queue.get(timeout=10)
            assert message.headers["task"] == RUN_JOB_TASK
            assert message.headers["argsrepr"] == repr([job_id]) or job_id in str(message.body)
            message.ack()
        finally:
            queue.close()
        pool = conn.default_channel.client.connection_pool
        assert issubclass(pool.connection_class, redis_lib.SSLConnection)
    assert check_redis_tls(url) is None


def test_redis_wrong_ca_is_refused_in_one_line(pki: Any, tls_redis: TlsRedis) -> None:
    from scheduler.infra.celery_app import create_celery_app

    url = tls_redis.url(ca=pki.other_ca_cert)
    with pytest.raises(redis_lib.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        redis_lib.Redis.from_url(url).ping()
    broker = create_celery_app(Settings(redis_url=url)).connection_for_write()
    with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"), broker:  # the broker verifies too
        broker.ensure_connection(max_retries=0)
    failure = check_redis_tls(url)
    assert failure is not None
    assert failure.line == (f"cloverq: cannot verify the TLS certificate of redis {tls_redis.address}: "
                            f"{failure.reason} (CA file {pki.other_ca_cert})")
    assert "certificate" in failure.reason and "\n" not in failure.line


def test_redis_expired_certificate_is_refused_in_one_line(pki: Any, expired_redis: TlsRedis) -> None:
    failure = check_redis_tls(expired_redis.url())
    assert failure is not None
    assert failure.line == (f"cloverq: cannot verify the TLS certificate of redis {expired_redis.address}: "
                            f"certificate has expired (CA file {pki.ca_cert})")


def test_redis_missing_ca_file_and_a_server_down(pki: Any, tls_redis: TlsRedis, tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    failure = check_redis_tls(tls_redis.url(ca=missing))
    assert failure is not None and failure.kind == "ca_file"
    assert failure.line == (f"cloverq: cannot read the TLS CA file for redis {tls_redis.address}: "
                            f"{missing}: No such file or directory")
    # Not a TLS failure: nothing to report, the service starts as it always did (/readyz 503).
    started = time.monotonic()
    down = f"rediss://127.0.0.1:{free_port()}/0?ssl_ca_certs={pki.ca_cert}"
    assert check_redis_tls(down) is None
    assert time.monotonic() - started < 3.0


def test_redis_client_certificate_required(pki: Any, tmp_path: Path) -> None:
    with tls_redis_server(tmp_path / "mtls", cert=pki.server_cert, key=pki.server_key, ca_cert=pki.ca_cert,
                          client_auth=True, client_cert=pki.client_cert, client_key=pki.client_key) as server:
        assert redis_lib.Redis.from_url(server.url()).ping()
        assert check_redis_tls(server.url()) is None
        failure = check_redis_tls(server.url(client_cert=False))
        assert failure is not None and failure.kind == "refused", failure
        assert failure.line == (f"cloverq: redis {server.address} refused the TLS connection: "
                                "tlsv13 alert certificate required")


def test_redis_through_tls_sentinels_verifies_and_a_wrong_ca_is_refused_in_one_line(
        pki: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``rediss+sentinel://``: the check asks a sentinel, then pings the master it names, over TLS."""
    from bench.fleet_services import SentinelSet, TlsFiles
    from tests.tls_servers import redis_tls_missing

    if redis_tls_missing() is not None:
        pytest.skip(str(redis_tls_missing()))
    redis_set = SentinelSet(tmp_path / "sentinel",
                            tls=TlsFiles(ca_cert=pki.ca_cert, cert=pki.server_cert, key=pki.server_key))
    try:
        redis_set.start()
        pinged: list[int] = []
        ping = redis_lib.Redis.ping

        def recorded(client: redis_lib.Redis, *args: Any, **kwargs: Any) -> Any:
            pinged.append(int(client.connection_pool.connection_kwargs["port"]))
            return ping(client, *args, **kwargs)

        with monkeypatch.context() as patched:
            patched.setattr(redis_lib.Redis, "ping", recorded)
            assert check_redis_tls(redis_set.url) is None
        assert pinged == [redis_set.master_port()]  # a sentinel named it, then the master verified
        failure = check_redis_tls(redis_set.url.replace(str(pki.ca_cert), str(pki.other_ca_cert)))
        assert failure is not None and failure.kind == "verify", failure
        assert failure.line == (f"cloverq: cannot verify the TLS certificate of redis "
                                f"127.0.0.1:{redis_set.sentinels[0].port}: {failure.reason} "
                                f"(CA file {pki.other_ca_cert})")
    finally:
        redis_set.stop()


# --- PostgreSQL ---------------------------------------------------------------------------------


def test_postgres_verify_full_engine_and_migrations(tls_postgres: TlsPostgres) -> None:
    from scheduler.infra.db import DatabaseTimeouts, make_engine, migrate

    admin = create_engine(tls_postgres.url(), isolation_level="AUTOCOMMIT")
    name = f"tls_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    admin.dispose()
    url = tls_postgres.url(name)
    migrate(url)
    engine = make_engine(url, timeouts=DatabaseTimeouts())
    try:
        with engine.connect() as conn:
            ssl_on = conn.execute(text("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")).scalar()
            assert ssl_on is True
            assert conn.execute(text("SELECT count(*) FROM jobs")).scalar() == 0
    finally:
        engine.dispose()
    assert check_postgres_tls(url) is None
    # The server takes TCP over TLS only: a client that would not use TLS is refused (not TLS's fault).
    assert check_postgres_tls(tls_postgres.url(name, sslmode="disable")) is None


def test_postgres_wrong_ca_is_refused_in_one_line(pki: Any, tls_postgres: TlsPostgres) -> None:
    url = tls_postgres.url(ca=pki.other_ca_cert)
    failure = check_postgres_tls(url)
    assert failure is not None
    assert failure.line.startswith(f"cloverq: cannot verify the TLS certificate of postgresql "
                                   f"{tls_postgres.address}: ")
    assert failure.line.endswith(f"(CA file {pki.other_ca_cert})")
    assert failure.reason != "certificate verify failed"  # the handshake of our own told why


def test_postgres_expired_certificate_is_refused_in_one_line(pki: Any) -> None:
    with tls_postgres_server(cert=pki.expired_server_cert, key=pki.expired_server_key,
                             ca_cert=pki.ca_cert) as server:
        failure = check_postgres_tls(server.url())
        assert failure is not None
        assert failure.line == (f"cloverq: cannot verify the TLS certificate of postgresql {server.address}: "
                                f"certificate has expired (CA file {pki.ca_cert})")
        settings = Settings(redis_url="redis://127.0.0.1:1/0", database_url=server.url())
        assert check_tls(settings) == failure  # plain redis:// is not checked: no connection made


# --- the services ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["worker", "beat"])
def test_service_exits_with_one_line(command: str, pki: Any, tls_redis: TlsRedis, tmp_path: Path) -> None:
    """The Redis URL comes from a ``*_FILE`` secret; the wrong CA stops the service at once."""
    secret = tmp_path / "redis-url"
    secret.write_text(tls_redis.url(ca=pki.other_ca_cert) + "\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith("CLOVERQ_")}
    env.update(CLOVERQ_REDIS_URL_FILE=str(secret), CLOVERQ_DATA_DIR=str(tmp_path / "data"))
    done = subprocess.run([sys.executable, "-m", "cli", command], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == CONFIG_ERROR_EXIT_CODE, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"cloverq: cannot verify the TLS certificate of redis {tls_redis.address}: ")
    assert lines[0].endswith(f"(CA file {pki.other_ca_cert})")
