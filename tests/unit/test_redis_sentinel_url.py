"""The ``redis+sentinel://`` URL: what it names, what it refuses, and the broker's kombu form."""

from __future__ import annotations

import pytest

from scheduler.infra.broker import releases_reservations
from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.redis_sentinel import (
    DEFAULT_SENTINEL_PORT,
    SENTINEL_TIMEOUT_SECONDS,
    SentinelUrl,
    is_sentinel_url,
    kombu_broker,
    parse_sentinel_url,
)
from scheduler.infra.settings import Settings


def test_full_url_names_sentinels_service_db_and_credentials() -> None:
    parsed = parse_sentinel_url(
        "redis+sentinel://app:p%40ss@10.0.0.1:26379,10.0.0.2:26380,[::1]:26381/mymaster/3"
        "?sentinel_password=s%2Fecret")
    assert parsed == SentinelUrl(
        sentinels=(("10.0.0.1", 26379), ("10.0.0.2", 26380), ("::1", 26381)), service="mymaster", db=3,
        username="app", password="p@ss", sentinel_password="s/ecret")
    assert parsed.master_kwargs() == {"db": 3, "username": "app", "password": "p@ss"}
    assert parsed.sentinel_kwargs()["password"] == "s/ecret"


def test_defaults_port_db_and_no_credentials() -> None:
    parsed = parse_sentinel_url("redis+sentinel://s1,s2:26380/cache")
    assert parsed.sentinels == (("s1", DEFAULT_SENTINEL_PORT), ("s2", 26380))
    assert (parsed.service, parsed.db, parsed.username, parsed.password) == ("cache", 0, None, None)
    assert parsed.master_kwargs() == {"db": 0}
    # The sentinels always get short timeouts, never a password they were not given.
    assert parsed.sentinel_kwargs() == {"socket_timeout": SENTINEL_TIMEOUT_SECONDS,
                                        "socket_connect_timeout": SENTINEL_TIMEOUT_SECONDS}


def test_password_only_as_redis_urls_write_it() -> None:
    parsed = parse_sentinel_url("redis+sentinel://:secret@h:1/m/0")
    assert (parsed.username, parsed.password) == (None, "secret")


@pytest.mark.parametrize("url", ["REDIS+SENTINEL://h/m", "redis+sentinel://h/m"])
def test_scheme_is_recognised_in_any_case(url: str) -> None:
    assert is_sentinel_url(url)


@pytest.mark.parametrize("url", ["redis://h:6379/0", "rediss://h/0", "unix:///tmp/r.sock", "sentinel://h/0"])
def test_other_urls_are_not_sentinel_urls(url: str) -> None:
    assert not is_sentinel_url(url)


@pytest.mark.parametrize(("url", "says"), [
    ("redis+sentinel:///mymaster/0", "names no sentinel"),
    ("redis+sentinel://h:26379", "path must be"),
    ("redis+sentinel://h:26379/", "path must be"),
    ("redis+sentinel://h/m/0/extra", "path must be"),
    ("redis+sentinel://h/m/zero", "DB must be a number"),
    ("redis+sentinel://h:port/m", "bad port"),
    ("redis+sentinel://:26379/m", "without a host"),
    ("redis+sentinel://h/m?ssl=true", "not supported"),
    (r"redis://h/0", r"not a redis\+sentinel"),
])
def test_malformed_urls_fail_saying_why(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_sentinel_url(url)


def test_kombu_form_has_one_sentinel_url_each_and_the_master_name() -> None:
    broker, options = kombu_broker("redis+sentinel://u:p%3Aw@h1:26379,[::1]/svc/2?sentinel_password=x")
    assert broker == "sentinel://u:p%3Aw@h1:26379/2;sentinel://u:p%3Aw@[::1]:26379/2"
    assert options["master_name"] == "svc"
    assert options["sentinel_kwargs"]["password"] == "x"


def test_celery_app_uses_cloverqs_sentinel_transport() -> None:
    """A Sentinel URL gets cloverq's channel (admission releases in the message's MULTI) on
    kombu's Sentinel transport; the visibility timeout and priority order stay."""
    app = create_celery_app(Settings(redis_url="redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/mymaster/1"))
    assert app.conf.broker_transport == "scheduler.infra.broker_sentinel:Transport"
    assert releases_reservations(app)
    assert app.conf.broker_url.startswith("sentinel://127.0.0.1:26379/1;sentinel://127.0.0.1:26380/1")
    options = app.conf.broker_transport_options
    assert options["master_name"] == "mymaster"
    assert options["queue_order_strategy"] == "priority" and options["visibility_timeout"] > 0
    assert app.connection_for_write().transport_cls == "scheduler.infra.broker_sentinel:Transport"


# --- TLS: rediss+sentinel:// --------------------------------------------------------------------


def test_tls_url_gives_sentinels_and_master_the_same_verified_tls() -> None:
    url = ("rediss+sentinel://:pw@h1:26379,h2/mymaster/2?ssl_ca_certs=%2Fetc%2Fca.pem"
           "&ssl_certfile=/c.pem&ssl_keyfile=/k.pem&sentinel_password=s")
    assert is_sentinel_url(url) and is_sentinel_url(url.upper())
    parsed = parse_sentinel_url(url)
    tls = {"ssl_cert_reqs": "required", "ssl_ca_certs": "/etc/ca.pem", "ssl_certfile": "/c.pem",
           "ssl_keyfile": "/k.pem"}
    assert parsed.tls_options() == tls
    assert parsed.master_kwargs() == {"db": 2, "password": "pw", "ssl": True, **tls}
    assert parsed.sentinel_kwargs() == {"socket_timeout": SENTINEL_TIMEOUT_SECONDS,
                                        "socket_connect_timeout": SENTINEL_TIMEOUT_SECONDS,
                                        "password": "s", "ssl": True, **tls}


def test_tls_url_without_options_verifies_against_the_system_cas() -> None:
    parsed = parse_sentinel_url("rediss+sentinel://h/m")
    assert parsed.tls_options() == {"ssl_cert_reqs": "required"}
    assert parsed.master_kwargs()["ssl"] is True


def test_tls_options_are_typed_and_checked() -> None:
    parsed = parse_sentinel_url("rediss+sentinel://h/m?ssl_cert_reqs=NONE&ssl_check_hostname=false")
    assert parsed.tls_options() == {"ssl_cert_reqs": "none", "ssl_check_hostname": False}


@pytest.mark.parametrize(("url", "says"), [
    ("redis+sentinel://h/m?ssl_ca_certs=/ca.pem", r"need TLS: use rediss\+sentinel"),
    ("rediss+sentinel://h/m?ssl_cert_reqs=maybe", "use none, optional or required"),
    ("rediss+sentinel://h/m?ssl_check_hostname=perhaps", "use true or false"),
    ("rediss+sentinel://h/m?ssl_certfile=/c.pem", "go together"),
    ("rediss+sentinel://h/m?ssl_ca_certs=", "is empty"),
    ("rediss+sentinel://h/m?ssl=true", "not supported"),
])
def test_bad_tls_options_fail_saying_why(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_sentinel_url(url)


def test_celery_app_passes_the_tls_options_to_the_sentinel_channel() -> None:
    """The broker gets TLS through its transport options (sentinels: ``sentinel_kwargs``; master:
    ``master_tls``, applied by cloverq's Sentinel channel), not Celery's ``broker_use_ssl``."""
    app = create_celery_app(Settings(redis_url="rediss+sentinel://127.0.0.1:26379/mymaster/1?ssl_ca_certs=/ca.pem"))
    assert app.conf.broker_transport == "scheduler.infra.broker_sentinel:Transport"
    options = app.conf.broker_transport_options
    assert options["master_tls"] == {"ssl_cert_reqs": "required", "ssl_ca_certs": "/ca.pem"}
    sentinel_kwargs = options["sentinel_kwargs"]
    assert sentinel_kwargs["ssl"] is True and sentinel_kwargs["ssl_ca_certs"] == "/ca.pem"
    assert not app.conf.broker_use_ssl
