"""The start-up TLS check (scheduler/infra/tls_check.py) and the Redis TLS options every client
shares; the real servers are in tests/integration/test_tls_backends.py."""

from __future__ import annotations

import ssl
import time
from pathlib import Path

import pytest
import redis

from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.redis_client import redis_ssl_options
from scheduler.infra.settings import Settings
from scheduler.infra.tls_check import (
    EXIT_CODE,
    TlsFailure,
    check_postgres_tls,
    check_redis_tls,
    exit_on_tls_failure,
    tls_error_of,
)


def test_rediss_options_verify_by_default_and_follow_the_url() -> None:
    assert redis_ssl_options("redis://127.0.0.1:6379/0") is None
    assert redis_ssl_options("rediss://r:6380/0") == {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    options = redis_ssl_options("rediss://:pw@r:6380/0?ssl_ca_certs=/etc/ca%20dir/ca.pem"
                                "&ssl_certfile=/c.pem&ssl_keyfile=/k.pem&ssl_check_hostname=false")
    assert options == {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/etc/ca dir/ca.pem",
                       "ssl_certfile": "/c.pem", "ssl_keyfile": "/k.pem", "ssl_check_hostname": False}
    assert redis_ssl_options("rediss://r/0?ssl_cert_reqs=none") == {"ssl_cert_reqs": ssl.CERT_NONE}
    with pytest.raises(ValueError, match="ssl_cert_reqs"):
        redis_ssl_options("rediss://r/0?ssl_cert_reqs=maybe")


def test_the_celery_broker_verifies_a_rediss_server() -> None:
    """kombu alone connects to a bare rediss:// URL with CERT_NONE; cloverq's app never does."""
    app = create_celery_app(Settings(redis_url="rediss://r:6380/0"))
    assert app.conf.broker_use_ssl == {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    assert app.conf.redis_backend_use_ssl == {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    assert app.conf.broker_transport == "scheduler.infra.broker:Transport"
    with app.connection_for_write() as conn:
        assert conn.ssl == {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    plain = create_celery_app(Settings(redis_url="redis://r:6379/0"))
    assert not plain.conf.broker_use_ssl


def _wrapped(error: BaseException) -> BaseException:
    """``error`` as redis-py and kombu hand it on: raised from, twice."""
    try:
        try:
            raise error
        except BaseException as inner:
            raise redis.ConnectionError("Error 1 connecting to h:1.") from inner
    except redis.ConnectionError as outer:
        return outer


def test_tls_errors_are_found_in_the_chain_and_others_are_not() -> None:
    expired = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: "
                                              "certificate has expired (_ssl.c:1006)")
    expired.verify_message = "certificate has expired"
    assert tls_error_of(_wrapped(expired)) == ("verify", "certificate has expired")
    alert = ssl.SSLError(1, "[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] tlsv13 alert certificate required")
    alert.reason = "TLSV13_ALERT_CERTIFICATE_REQUIRED"
    assert tls_error_of(_wrapped(alert)) == ("refused", "tlsv13 alert certificate required")
    text_only = redis.ConnectionError(
        "Error 1 connecting to h:1. [SSL: CERTIFICATE_VERIFY_FAILED] certificate "
        "verify failed: self-signed certificate in certificate chain (_ssl.c:1006).")
    assert tls_error_of(text_only) == ("verify", "self-signed certificate in certificate chain")
    assert tls_error_of(_wrapped(ConnectionRefusedError(111, "Connection refused"))) is None
    assert tls_error_of(redis.AuthenticationError("invalid password")) is None


def test_the_line_names_service_address_reason_and_ca_never_the_url() -> None:
    failure = TlsFailure("redis", "10.0.0.5:6380", "verify", "certificate has expired", "/etc/ca.pem")
    assert failure.line == ("cloverq: cannot verify the TLS certificate of redis 10.0.0.5:6380: "
                            "certificate has expired (CA file /etc/ca.pem)")
    system = TlsFailure("postgresql", "db:5432", "verify", "unable to get local issuer certificate")
    assert system.line.endswith("(the system's CA certificates)")


def test_nothing_is_checked_without_tls(tmp_path: Path) -> None:
    started = time.monotonic()  # no server at these addresses: no connection may be tried
    assert check_redis_tls("redis://127.0.0.1:1/0") is None
    assert check_postgres_tls(f"sqlite:///{tmp_path}/x.db") is None
    assert check_postgres_tls("postgresql+psycopg://u:p@127.0.0.1:1/db") is None
    assert check_postgres_tls("postgresql+psycopg://u:p@127.0.0.1:1/db?sslmode=prefer") is None
    assert check_postgres_tls("not a url") is None
    assert time.monotonic() - started < 1.0
    assert not (tmp_path / "x.db").exists()


def test_a_missing_ca_file_is_reported_before_connecting(tmp_path: Path) -> None:
    missing = tmp_path / "ca.pem"
    failure = check_postgres_tls(f"postgresql+psycopg://u:secret@127.0.0.1:1/db?sslmode=verify-full"
                                 f"&sslrootcert={missing}")
    assert failure is not None and failure.kind == "ca_file"
    assert failure.line == (f"cloverq: cannot read the TLS CA file for postgresql 127.0.0.1:1: {missing}: "
                            "No such file or directory")
    assert "secret" not in failure.line


def test_exit_on_tls_failure_prints_one_line_and_exits_78(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "ca.pem"
    settings = Settings(redis_url=f"rediss://:pw@127.0.0.1:1/0?ssl_ca_certs={missing}",
                        database_url=f"sqlite:///{tmp_path}/x.db")
    with pytest.raises(SystemExit) as exited:
        exit_on_tls_failure(settings)
    assert exited.value.code == EXIT_CODE == 78
    err = capsys.readouterr().err
    assert err == (f"cloverq: cannot read the TLS CA file for redis 127.0.0.1:1: {missing}: "
                   "No such file or directory\n")
    exit_on_tls_failure(settings, redis=False)  # the database alone (cloverq migrate): fine
