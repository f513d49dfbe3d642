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
from scheduler.infra.settings import CONFIG_ERROR_EXIT_CODE, Settings
from scheduler.infra.tls_check import (
    TlsFailure,
    check_postgres_tls,
    check_redis_tls,
    exit_on_tls_failure,
    tls_error_of,
)
from tests.conftest import free_port


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


SENTINELS = "127.0.0.1:1,127.0.0.1:2"  # nothing listens there: a check that connects would fail slowly


@pytest.mark.parametrize(("redis_url", "address"), [
    ("rediss://:pw@127.0.0.1:1/0?ssl_ca_certs={ca}", "127.0.0.1:1"),
    ("rediss+sentinel://:pw@{sentinels}/mymaster/0?ssl_ca_certs={ca}", SENTINELS),
])
def test_exit_on_tls_failure_prints_one_line_and_exits_78(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], redis_url: str, address: str) -> None:
    missing = tmp_path / "ca.pem"
    settings = Settings(redis_url=redis_url.format(ca=missing, sentinels=SENTINELS),
                        database_url=f"sqlite:///{tmp_path}/x.db")
    with pytest.raises(SystemExit) as exited:
        exit_on_tls_failure(settings)
    assert exited.value.code == CONFIG_ERROR_EXIT_CODE == 78
    err = capsys.readouterr().err
    assert err == (f"cloverq: cannot read the TLS CA file for redis {address}: {missing}: "
                   "No such file or directory\n")
    exit_on_tls_failure(settings, redis=False)  # the database alone (cloverq migrate): fine


# --- rediss+sentinel:// (scheduler/infra/redis_sentinel.py) -----------------------------------------


def test_plain_and_unparsable_sentinel_urls_are_not_checked(tmp_path: Path) -> None:
    started = time.monotonic()
    assert check_redis_tls(f"redis+sentinel://{SENTINELS}/mymaster/0") is None
    assert check_redis_tls(f"rediss+sentinel://{SENTINELS}/") is None  # no service: its start says so
    assert check_redis_tls(f"rediss+sentinel://{SENTINELS}/mymaster?ssl_certfile=/c.pem") is None  # no key
    assert time.monotonic() - started < 1.0


def test_a_sentinel_url_with_a_missing_ca_file_is_reported_before_connecting(tmp_path: Path) -> None:
    missing = tmp_path / "ca.pem"
    started = time.monotonic()
    failure = check_redis_tls(f"rediss+sentinel://:secret@{SENTINELS}/mymaster/0?ssl_ca_certs={missing}"
                              "&sentinel_password=other-secret")
    assert failure is not None and failure.kind == "ca_file"
    assert failure.line == (f"cloverq: cannot read the TLS CA file for redis {SENTINELS}: {missing}: "
                            "No such file or directory")
    assert "secret" not in failure.line
    assert time.monotonic() - started < 1.0
    # ssl_cert_reqs=none verifies nothing: the CA file is not read (as with rediss://).
    assert check_redis_tls(f"rediss+sentinel://127.0.0.1:{free_port()}/mymaster?ssl_ca_certs={missing}"
                           "&ssl_cert_reqs=none") is None


@pytest.mark.parametrize("scheme", ["rediss", "rediss+sentinel"])
def test_an_unreadable_client_certificate_or_key_is_reported_before_connecting(
        tmp_path: Path, scheme: str) -> None:
    ca, cert = tmp_path / "ca.pem", tmp_path / "client.pem"
    ca.write_text("not read as a certificate here")
    cert.write_text("not read as a certificate here")
    missing, directory = tmp_path / "missing.pem", tmp_path / "a-directory"
    directory.mkdir()
    base = f"{scheme}://:secret@127.0.0.1:1/{'mymaster/0' if 'sentinel' in scheme else '0'}?ssl_ca_certs={ca}"
    started = time.monotonic()
    failure = check_redis_tls(f"{base}&ssl_certfile={missing}&ssl_keyfile={cert}")
    assert failure is not None and failure.kind == "cert_file"
    assert failure.line == (f"cloverq: cannot read the TLS client certificate for redis 127.0.0.1:1: "
                            f"{missing}: No such file or directory")
    failure = check_redis_tls(f"{base}&ssl_certfile={cert}&ssl_keyfile={directory}")
    assert failure is not None and failure.kind == "key_file"
    assert failure.line == (f"cloverq: cannot read the TLS client key for redis 127.0.0.1:1: "
                            f"{directory}: Is a directory")
    assert time.monotonic() - started < 1.0


def test_sentinels_that_do_not_answer_are_not_a_tls_failure(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not read: no sentinel answers")
    sentinels = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    started = time.monotonic()
    assert check_redis_tls(f"rediss+sentinel://{sentinels}/mymaster/0?ssl_ca_certs={ca}") is None
    assert time.monotonic() - started < 3.0
