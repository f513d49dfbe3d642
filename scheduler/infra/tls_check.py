"""Start-up check: a TLS certificate that cannot be verified stops a service at once, in one line.

``cloverq api``, ``cloverq worker``, ``cloverq beat`` and ``cloverq migrate`` call
:func:`exit_on_tls_failure` before they start. It connects once to Redis (a ``rediss://`` URL;
with ``rediss+sentinel://``, a sentinel and then the master it names) and to PostgreSQL
(``sslmode`` ``require``, ``verify-ca`` or ``verify-full``, in the URL or ``PGSSLMODE``), the way
the service itself will, and when the TLS handshake fails for good it prints one line to stderr
and exits with ``CONFIG_ERROR_EXIT_CODE`` (78, EX_CONFIG)::

    cloverq: cannot verify the TLS certificate of redis 10.0.0.5:6380: certificate has expired (CA file /ca)

A failed handshake is not something a retry fixes (wrong CA, expired or mismatched certificate,
a CA file, client certificate or key that cannot be read, a server refusing our client
certificate), so it is reported, not
retried; a Celery worker would otherwise retry the broker forever and the API answer 503 with
the cause buried in a log. Every other failure (server down, refused, slow, wrong password)
keeps today's behaviour: the check says nothing and the service starts (the API with ``/readyz``
503 until the backends answer, the worker and beat retrying the broker). Plain ``redis://`` and
``redis+sentinel://``, SQLite and PostgreSQL without ``sslmode`` are not checked: no connection is
made. A Redis URL's files (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``) are read before any
connection.

The line names the service, the address, the reason as the TLS library gave it, and the CA file,
never the URL (it may hold a password). libpq says only "certificate verify failed"; the reason
is then read by a handshake of our own (PostgreSQL's ``SSLRequest``, then TLS with the same CA
and host name check), which gives OpenSSL's words ("certificate has expired").
"""

from __future__ import annotations

import os
import re
import socket
import ssl
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import redis
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry
from sqlalchemy import make_url
from sqlalchemy.exc import ArgumentError

from scheduler.infra.db import DatabaseTimeouts, make_engine
from scheduler.infra.redis_client import is_tls_url, redis_ssl_options
from scheduler.infra.redis_sentinel import CERT_REQS, SentinelUrl, is_sentinel_url, parse_sentinel_url
from scheduler.infra.settings import CONFIG_ERROR_EXIT_CODE, Settings

REDIS_TIMEOUT_SECONDS = 5.0
ALERT_WAIT_SECONDS = 2.0  # _probe_redis_alert: how long to listen for a refusal
POSTGRES_TLS_MODES = ("require", "verify-ca", "verify-full")
_POSTGRES_SSL_REQUEST = struct.pack("!ii", 8, 80877103)
_OPENSSL_REASON = re.compile(r"certificate verify failed: (?P<reason>[^()\n]+?)\s*(?:\(_ssl|\.\s|\.?$)")


# verify: the server's certificate; refused: the server refused us; ca_file, cert_file, key_file:
# a file of ours that cannot be read.
Kind = Literal["verify", "ca_file", "cert_file", "key_file", "refused"]
_REDIS_FILES: dict[str, Kind] = {  # a Redis URL's file options, read before connecting
    "ssl_ca_certs": "ca_file", "ssl_certfile": "cert_file", "ssl_keyfile": "key_file"}


@dataclass(frozen=True)
class TlsFailure:
    """Why a TLS connection to a backend cannot work: what :func:`exit_on_tls_failure` prints."""

    service: str  # "redis" or "postgresql"
    address: str  # host:port (Sentinel, before connecting: every sentinel's, comma-separated)
    kind: Kind
    reason: str
    ca_file: str | None = None  # None: the system's CAs
    file: str | None = None  # cert_file, key_file: the file that cannot be read


    @property
    def line(self) -> str:
        ca = f"CA file {self.ca_file}" if self.ca_file else "the system's CA certificates"
        if self.kind == "ca_file":
            return (f"cloverq: cannot read the TLS CA file for {self.service} {self.address}: "
                    f"{self.ca_file}: {self.reason}")
        if self.kind in ("cert_file", "key_file"):
            what = "certificate" if self.kind == "cert_file" else "key"
            return (f"cloverq: cannot read the TLS client {what} for {self.service} {self.address}: "
                    f"{self.file}: {self.reason}")
        if self.kind == "refused":
            return f"cloverq: {self.service} {self.address} refused the TLS connection: {self.reason}"
        return (f"cloverq: cannot verify the TLS certificate of {self.service} {self.address}: "
                f"{self.reason} ({ca})")


class TlsCheckError(RuntimeError):
    """A :class:`TlsFailure` as an exception (its message is the one line)."""

    def __init__(self, failure: TlsFailure) -> None:
        super().__init__(failure.line)
        self.failure = failure


# --- classifying an error -------------------------------------------------------------------------


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 20:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def tls_error_of(exc: BaseException) -> tuple[Literal["verify", "refused"], str] | None:
    """(kind, reason) when ``exc`` (or anything in its chain) is a TLS failure that a retry cannot
    fix: a certificate that does not verify, or the server refusing the handshake (a TLS alert);
    None for anything else (refused connection, timeout, authentication...)."""
    for item in _chain(exc):
        if isinstance(item, ssl.SSLCertVerificationError):
            return "verify", str(item.verify_message or item.reason or item)
    for item in _chain(exc):
        if isinstance(item, ssl.SSLError) and "ALERT" in str(item.reason or ""):
            return "refused", str(item.reason).lower().replace("_", " ")
    text = " ".join(str(item) for item in _chain(exc))
    found = _OPENSSL_REASON.search(text)
    if found and "CERTIFICATE_VERIFY_FAILED" in text:
        return "verify", found.group("reason")
    return None


def _readable(path: str) -> str | None:
    """Why the file at ``path`` (a CA file, client certificate or key) cannot be read (None: it can)."""
    try:
        with open(path, "rb"):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


# --- Redis ------------------------------------------------------------------------------------------


def check_redis_tls(url: str, *, timeout: float = REDIS_TIMEOUT_SECONDS) -> TlsFailure | None:
    """Connect once to the ``rediss://`` Redis at ``url`` as cloverq's clients do (with
    ``rediss+sentinel://``: see :func:`check_sentinel_tls`); the TLS failure, or None (no TLS, it
    verified, or it failed for a reason that is not TLS)."""
    if is_sentinel_url(url):
        return check_sentinel_tls(url, timeout=timeout)
    if not is_tls_url(url):
        return None
    params = parse_url(url)
    host, port = str(params.get("host") or "localhost"), int(params.get("port") or 6379)
    options = redis_ssl_options(url) or {}
    unreadable = _unreadable_redis_file(options, f"{host}:{port}")
    if unreadable is not None:
        return unreadable
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout,
                                  retry=Retry(NoBackoff(), 0))
    try:
        client.ping()
    except Exception as exc:  # any failure: only TLS ones are reported
        return _redis_tls_failure(exc, host, port, options, timeout)
    finally:
        client.close()
    return None


def check_sentinel_tls(url: str, *, timeout: float = REDIS_TIMEOUT_SECONDS) -> TlsFailure | None:
    """The check of a ``rediss+sentinel://`` URL: its files first (the line names every sentinel),
    then the sentinels in turn until one names the master (a certificate that does not verify
    stops there), then the master the way cloverq's clients connect to it. Plain
    ``redis+sentinel://`` and a URL that does not parse (the service's own start says why): None,
    no connection."""
    try:
        parsed = parse_sentinel_url(url)
    except ValueError:
        return None
    if parsed.tls is None:
        return None
    options = _sentinel_ssl_options(parsed)
    sentinels = ",".join(f"{host}:{port}" for host, port in parsed.sentinels)
    unreadable = _unreadable_redis_file(options, sentinels)
    if unreadable is not None:
        return unreadable
    timeouts: dict[str, Any] = {"socket_connect_timeout": timeout, "socket_timeout": timeout,
                                "retry": Retry(NoBackoff(), 0)}
    master: Any = None
    for host, port in parsed.sentinels:
        sentinel = redis.Redis(host=host, port=port, decode_responses=True,
                               **{**parsed.sentinel_kwargs(), **timeouts})
        try:
            master = sentinel.sentinel_get_master_addr_by_name(parsed.service)
        except Exception as exc:  # any failure: only TLS ones are reported, else the next sentinel
            failure = _redis_tls_failure(exc, host, port, options, timeout)
            if failure is not None:
                return failure
        finally:
            sentinel.close()
        if master:
            break
    if not master:  # no sentinel answered, or none knows the service: not a TLS failure
        return None
    host, port = str(master[0]), int(master[1])
    client = redis.Redis(host=host, port=port, **{**parsed.master_kwargs(), **timeouts})
    try:
        client.ping()
    except Exception as exc:  # any failure: only TLS ones are reported
        return _redis_tls_failure(exc, host, port, options, timeout)
    finally:
        client.close()
    return None


def _sentinel_ssl_options(parsed: SentinelUrl) -> dict[str, Any]:
    """The URL's TLS options as :func:`redis_ssl_options` gives a ``rediss://`` URL's
    (``ssl_cert_reqs`` an :mod:`ssl` constant)."""
    options = parsed.tls_options()
    options["ssl_cert_reqs"] = CERT_REQS[str(options["ssl_cert_reqs"])]
    return options


def _unreadable_redis_file(options: dict[str, Any], address: str) -> TlsFailure | None:
    """The first of the CA file (unless nothing is verified), client certificate and key that
    cannot be read, as a failure."""
    for option, kind in _REDIS_FILES.items():
        path = options.get(option)
        if not path or (kind == "ca_file" and options.get("ssl_cert_reqs") == ssl.CERT_NONE):
            continue
        unreadable = _readable(str(path))
        if unreadable:
            if kind == "ca_file":
                return TlsFailure("redis", address, kind, unreadable, str(path))
            return TlsFailure("redis", address, kind, unreadable, file=str(path))
    return None


def _redis_tls_failure(exc: BaseException, host: str, port: int, options: dict[str, Any],
                       timeout: float) -> TlsFailure | None:
    """``exc`` (a failed command to the Redis server or sentinel at host:port) as a TLS failure,
    or None when it is not one."""
    found = tls_error_of(exc)
    if found is None and _closed_after_handshake(exc):
        found = _probe_redis_alert(host, port, options, timeout)
    if found is None:
        return None
    ca_file = options.get("ssl_ca_certs") or options.get("ssl_ca_path")
    return TlsFailure("redis", f"{host}:{port}", found[0], found[1], str(ca_file) if ca_file else None)


def _closed_after_handshake(exc: BaseException) -> bool:
    """Whether the server hung up without a word on the TLS connection (EOF, reset)."""
    return any(isinstance(item, (ssl.SSLError, ConnectionResetError, BrokenPipeError))
               or "Connection closed by server" in str(item) for item in _chain(exc))


def _probe_redis_alert(host: str, port: int, options: dict[str, Any],
                       timeout: float) -> tuple[Literal["verify", "refused"], str] | None:
    """A server refusing our client certificate does so after the TLS 1.3 handshake: its alert
    races the PING we sent, and a reset may discard it. Shake hands again and send nothing, only
    listen (at most :data:`ALERT_WAIT_SECONDS`): the alert, if any, is then read for sure."""
    reqs = options.get("ssl_cert_reqs", ssl.CERT_REQUIRED)
    try:
        context = ssl.create_default_context(cafile=options.get("ssl_ca_certs"),
                                             capath=options.get("ssl_ca_path"))
        context.check_hostname = bool(options.get("ssl_check_hostname", True)) and reqs != ssl.CERT_NONE
        context.verify_mode = reqs
        if options.get("ssl_certfile"):
            context.load_cert_chain(options["ssl_certfile"], options.get("ssl_keyfile"),
                                    options.get("ssl_password"))
        with socket.create_connection((host, port), timeout=timeout) as sock, \
                context.wrap_socket(sock, server_hostname=host) as tls:
            tls.settimeout(min(timeout, ALERT_WAIT_SECONDS))
            tls.recv(1)
    except (OSError, ValueError) as exc:
        return tls_error_of(exc)
    return None


# --- PostgreSQL ---------------------------------------------------------------------------------------


def _postgres_tls_target(url: str) -> tuple[str, int, str, str | None] | None:
    """(host, port, sslmode, root certificate) of a PostgreSQL URL that uses TLS, else None."""
    try:
        parsed = make_url(url)
    except ArgumentError:  # not a URL: the service's own start says so
        return None
    if parsed.get_backend_name() != "postgresql":
        return None
    query = parsed.query

    def first(name: str) -> str | None:
        value = query.get(name)
        if isinstance(value, tuple):
            value = value[0] if value else None
        return value

    sslmode = first("sslmode") or os.environ.get("PGSSLMODE")
    if sslmode not in POSTGRES_TLS_MODES:
        return None
    host = parsed.host or first("host") or os.environ.get("PGHOST") or ""
    if not host or host.startswith("/") or "," in host:  # a unix socket: no TLS; several hosts: not checked
        return None
    port = parsed.port or int(os.environ.get("PGPORT") or 5432)
    root = first("sslrootcert") or os.environ.get("PGSSLROOTCERT")
    if root is None:
        default = Path.home() / ".postgresql" / "root.crt"
        root = str(default) if default.exists() or sslmode.startswith("verify") else None
    return host, port, sslmode, root


def _probe_postgres_certificate(host: str, port: int, root: str | None, *, check_hostname: bool,
                                timeout: float) -> str | None:
    """OpenSSL's reason why the PostgreSQL server's certificate does not verify (None: it does,
    or the server could not be asked): a handshake of our own after PostgreSQL's SSLRequest."""
    context = ssl.create_default_context()
    if root and root != "system":
        context = ssl.create_default_context(cafile=root)
    context.check_hostname = check_hostname
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(_POSTGRES_SSL_REQUEST)
            if sock.recv(1) != b"S":
                return None
            with context.wrap_socket(sock, server_hostname=host):
                return None
    except ssl.SSLCertVerificationError as exc:
        return str(exc.verify_message or exc.reason or exc)
    except (OSError, ValueError):
        return None


def check_postgres_tls(url: str, *, timeout: float = 5.0) -> TlsFailure | None:
    """Connect once to the PostgreSQL at ``url`` (through :func:`scheduler.infra.db.make_engine`)
    when it asks for TLS; the TLS failure, or None."""
    target = _postgres_tls_target(url)
    if target is None:
        return None
    host, port, sslmode, root = target
    address = f"{host}:{port}"
    verifies = sslmode.startswith("verify") or root is not None
    if verifies and root and root != "system":
        unreadable = _readable(root)
        if unreadable:
            return TlsFailure("postgresql", address, "ca_file", unreadable, root)
    engine = make_engine(url, pool_size=1, timeouts=DatabaseTimeouts(connect=timeout))
    try:
        with engine.connect():
            return None
    except Exception as exc:  # any failure: only TLS ones are reported
        message = str(getattr(exc, "orig", None) or exc)
        ca = None if root == "system" else root
        found = tls_error_of(exc)
        if found is not None:
            return TlsFailure("postgresql", address, found[0], found[1], ca)
        if "certificate verify failed" in message or "does not match host name" in message:
            reason = _probe_postgres_certificate(host, port, root, check_hostname=sslmode == "verify-full",
                                                 timeout=timeout)
            if reason is None:  # our handshake verified: libpq's own words
                reason = message.rsplit("failed: ", 1)[-1].removeprefix("SSL error: ").strip()
            return TlsFailure("postgresql", address, "verify", reason, ca)
        if "SSL error" in message and "alert" in message:
            reason = message.rsplit("SSL error: ", 1)[-1].strip()
            return TlsFailure("postgresql", address, "refused", reason, ca)
        return None
    finally:
        engine.dispose()


# --- the start-up check ---------------------------------------------------------------------------------


def check_tls(settings: Settings, *, redis: bool = True, database: bool = True) -> TlsFailure | None:
    """The first TLS failure of this deployment's Redis, then its database; None when both are fine
    (or not on TLS, or failing for another reason)."""
    failure = check_redis_tls(settings.resolved_redis_url) if redis else None
    if failure is None and database:
        failure = check_postgres_tls(settings.resolved_database_url,
                                     timeout=settings.database.connect_timeout_seconds)
    return failure


def exit_on_tls_failure(settings: Settings, *, redis: bool = True, database: bool = True) -> None:
    """Exit with one line on stderr and ``CONFIG_ERROR_EXIT_CODE`` when :func:`check_tls` finds a failure
    (``cloverq migrate`` checks only the database)."""
    failure = check_tls(settings, redis=redis, database=database)
    if failure is not None:
        print(failure.line, file=sys.stderr, flush=True)
        sys.exit(CONFIG_ERROR_EXIT_CODE)
