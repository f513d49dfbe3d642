"""Redis behind Sentinel: the ``redis+sentinel://`` URL and clients that follow the master.

Every Redis client of cloverq reads one URL (``CLOVERQ_REDIS_URL``). With Sentinel it names the
sentinels, the monitored service and the DB instead of one server::

    redis+sentinel://[[username]:password@]host1[:26379],host2[:26379],.../service[/db][?sentinel_password=...]
    rediss+sentinel://...same.../service[/db]?ssl_ca_certs=/etc/cloverq/ca.pem[&ssl_certfile=..&ssl_keyfile=..]

``password`` (and ``username``) authenticate to the Redis servers, ``sentinel_password`` to the
sentinels (when they have a ``requirepass`` of their own). Nothing else is accepted, so a typo
fails at start-up instead of being ignored.

**TLS** (``rediss+sentinel://``): every connection, to the sentinels and to the master they name,
is TLS and verifies the server's certificate (``ssl_cert_reqs=required`` unless the URL says
otherwise) against ``ssl_ca_certs`` (else the system's CAs), for the address connected to (the
host of the URL for a sentinel, the address the sentinels report for the master: give the
servers certificates for those, e.g. their IPs). ``ssl_certfile`` / ``ssl_keyfile`` send a client
certificate (servers with ``tls-auth-clients yes``); ``ssl_check_hostname=false`` turns the name
check off. One set of options serves both the sentinels and the Redis servers (Redis' own
``tls-replication yes`` makes the sentinels talk TLS to the servers too). The Celery broker gets
the same options (``kombu_broker``, ``scheduler.infra.broker_sentinel``).

**Following the master.** The clients are redis-py's own (``redis.sentinel.Sentinel.master_for``
and its asyncio twin): a new connection asks the sentinels where the master is; a connection
that errors (the master died) or gets ``READONLY`` / ``UNBLOCKED`` (the master was demoted) is
dropped and the command fails, and the next one reconnects to the master the sentinels name. That
alone leaves a gap after a *coordinated* failover (``SENTINEL FAILOVER``, a planned switch): the
old master stays a writable master for about ten seconds more, until the sentinels turn it into
a replica, and every pooled connection still open to it keeps writing there, writes the demotion
then throws away. So the pools here (:class:`FollowingPool`, :class:`AsyncFollowingPool`) also
ask the sentinels, at most every :data:`FOLLOW_SECONDS` when a connection is taken, and drop
their idle connections when the answer changed (redis-py's ``get_master_address`` does that);
a connection in use when the master moved is closed when it is given back. The Celery broker's
channels do the same (``scheduler.infra.broker_sentinel``). When no sentinel answers, the pools
keep the connections they have: the sentinels being away does not take Redis away.
"""

from __future__ import annotations

import contextlib
import ssl
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelConnectionPool
from redis.sentinel import Sentinel, SentinelConnectionPool

SCHEME = "redis+sentinel"
TLS_SCHEME = "rediss+sentinel"
DEFAULT_SENTINEL_PORT = 26379
FOLLOW_SECONDS = 1.0  # a pool asks the sentinels where the master is at most this often
SENTINEL_TIMEOUT_SECONDS = 1.0  # one sentinel's connect or reply; then discovery tries the next
# TLS options (``rediss+sentinel://`` only), named as redis-py's ``rediss://`` query names them.
TLS_OPTIONS = frozenset(
    {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname"})
_OPTIONS = frozenset({"sentinel_password"}) | TLS_OPTIONS
# ssl_cert_reqs names -> ssl constants (rediss:// and rediss+sentinel:// URLs, the start-up check)
CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
_BOOLEANS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


@dataclass(frozen=True, slots=True)
class SentinelUrl:
    """A parsed ``redis+sentinel://`` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a repr (logs, tracebacks)
    sentinel_password: str | None = field(default=None, repr=False)
    tls: tuple[tuple[str, Any], ...] | None = None  # rediss+sentinel://: the ssl_* options (may be empty)

    def tls_options(self) -> dict[str, Any]:
        """redis-py's TLS options of every connection (sentinels and master): ``ssl_cert_reqs``
        ``required`` unless the URL says otherwise; empty without TLS."""
        if self.tls is None:
            return {}
        return {"ssl_cert_reqs": "required", **dict(self.tls)}

    def sentinel_kwargs(self) -> dict[str, Any]:
        """Connection options of the sentinel clients: short timeouts always (a sentinel that
        hangs must not hang master discovery, even for a client whose reads block on purpose)."""
        options: dict[str, Any] = {"socket_timeout": SENTINEL_TIMEOUT_SECONDS,
                                   "socket_connect_timeout": SENTINEL_TIMEOUT_SECONDS}
        if self.sentinel_password is not None:
            options["password"] = self.sentinel_password
        if self.tls is not None:
            options.update(ssl=True, **self.tls_options())
        return options

    def master_kwargs(self) -> dict[str, Any]:
        """The DB, credentials and TLS of the connections to the master (``ssl=True`` makes
        redis-py's Sentinel pool use its TLS connection class)."""
        options: dict[str, Any] = {"db": self.db}
        if self.username is not None:
            options["username"] = self.username
        if self.password is not None:
            options["password"] = self.password
        if self.tls is not None:
            options.update(ssl=True, **self.tls_options())
        return options


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` names a Sentinel-managed Redis (``redis+sentinel://``, ``rediss+sentinel://``)."""
    return url.split("://", 1)[0].lower() in (SCHEME, TLS_SCHEME)


def parse_sentinel_url(url: str) -> SentinelUrl:
    """``url`` parsed (see the module docstring); ValueError saying what is wrong."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in (SCHEME, TLS_SCHEME):
        raise ValueError(f"not a {SCHEME}:// or {TLS_SCHEME}:// URL: {parts.scheme}://")
    secure = parts.scheme.lower() == TLS_SCHEME
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    sentinels = tuple(_host_port(item) for item in hosts.split(",") if item.strip())
    if not sentinels:
        raise ValueError(f"{SCHEME}:// URL names no sentinel (host:port[,host:port...])")
    path = [segment for segment in parts.path.split("/") if segment]
    if not path or len(path) > 2:
        raise ValueError(f"{SCHEME}:// URL path must be /<service name>[/<db>], not {parts.path!r}")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"{SCHEME}:// URL DB must be a number, not {path[1]!r}")
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - _OPTIONS)
    if unknown:
        raise ValueError(f"{SCHEME}:// URL option(s) {unknown} not supported (only {sorted(_OPTIONS)})")
    sentinel_password = query["sentinel_password"][-1] if "sentinel_password" in query else None
    tls_given = sorted(set(query) & TLS_OPTIONS)
    if tls_given and not secure:
        raise ValueError(f"{SCHEME}:// URL option(s) {tls_given} need TLS: use {TLS_SCHEME}://")
    return SentinelUrl(
        sentinels=sentinels, service=unquote(path[0]), db=int(path[1]) if len(path) == 2 else 0,
        username=unquote(username) or None, password=unquote(password) if userinfo and password else None,
        sentinel_password=sentinel_password,
        tls=_tls_options({key: query[key][-1] for key in tls_given}) if secure else None,
    )


def _tls_options(given: dict[str, str]) -> tuple[tuple[str, Any], ...]:
    """The URL's ``ssl_*`` options checked and typed as redis-py takes them."""
    options: dict[str, Any] = {}
    for key, value in given.items():
        if key == "ssl_cert_reqs":
            if value.lower() not in CERT_REQS:
                raise ValueError(
                    f"{TLS_SCHEME}:// URL ssl_cert_reqs={value!r}: use none, optional or required")
            options[key] = value.lower()
        elif key == "ssl_check_hostname":
            if value.lower() not in _BOOLEANS:
                raise ValueError(f"{TLS_SCHEME}:// URL ssl_check_hostname={value!r}: use true or false")
            options[key] = _BOOLEANS[value.lower()]
        elif not value:
            raise ValueError(f"{TLS_SCHEME}:// URL {key} is empty")
        else:
            options[key] = value
    if ("ssl_certfile" in options) != ("ssl_keyfile" in options):
        raise ValueError(f"{TLS_SCHEME}:// URL: ssl_certfile and ssl_keyfile go together")
    return tuple(sorted(options.items()))


def _host_port(item: str) -> tuple[str, int]:
    item = item.strip()
    if item.startswith("["):  # [IPv6]:port
        host, _, rest = item[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = item.partition(":")
    if not host:
        raise ValueError(f"{SCHEME}:// URL has a sentinel without a host: {item!r}")
    if port and not port.isdigit():
        raise ValueError(f"{SCHEME}:// URL has a sentinel with a bad port: {item!r}")
    return host, int(port) if port else DEFAULT_SENTINEL_PORT


def kombu_broker(url: str) -> tuple[str, dict[str, Any]]:
    """kombu's form of ``url`` for its Sentinel transport: the broker URL (one ``sentinel://``
    per sentinel, ``;``-separated; each carries the servers' credentials and the DB) and the
    transport options (``master_name``, ``sentinel_kwargs``; with TLS ``master_tls``, the master
    connections' options, which ``scheduler.infra.broker_sentinel``'s channel applies)."""
    parsed = parse_sentinel_url(url)
    auth = ""
    if parsed.username is not None or parsed.password is not None:
        auth = f"{quote(parsed.username or '', safe='')}:{quote(parsed.password or '', safe='')}@"
    hosts = [f"[{host}]" if ":" in host else host for host, _ in parsed.sentinels]
    broker = ";".join(f"sentinel://{auth}{host}:{port}/{parsed.db}"
                      for host, (_, port) in zip(hosts, parsed.sentinels, strict=True))
    options: dict[str, Any] = {"master_name": parsed.service, "sentinel_kwargs": parsed.sentinel_kwargs()}
    if parsed.tls is not None:
        options["master_tls"] = parsed.tls_options()
    return broker, options


# --- following the master ---------------------------------------------------------------------------


def _due(pool: Any) -> bool:
    """Whether ``pool`` should ask the sentinels again (and note that it does now)."""
    now = time.monotonic()
    if now - getattr(pool, "_cloverq_followed_at", float("-inf")) < FOLLOW_SECONDS:
        return False
    pool._cloverq_followed_at = now
    return True


def follow_master(pool: SentinelConnectionPool) -> None:
    """Ask the sentinels where ``pool``'s master is, at most every :data:`FOLLOW_SECONDS`; when it
    moved, redis-py drops the pool's idle connections. No sentinel answering changes nothing."""
    if _due(pool):
        with contextlib.suppress(redis.RedisError):
            pool.get_master_address()


def master_moved(pool: SentinelConnectionPool, connection: Any) -> bool:
    """Whether the connected ``connection`` of ``pool`` talks to a server that is no longer the
    master the sentinels name (asked at most every :data:`FOLLOW_SECONDS`)."""
    follow_master(pool)
    where = pool.master_address
    connected = getattr(connection, "_sock", None) is not None
    return connected and where is not None and (connection.host, connection.port) != tuple(where)


class FollowingPool(SentinelConnectionPool):
    """redis-py's Sentinel pool that also follows a master that moved while its old one still
    answers (module docstring)."""

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        follow_master(self)
        return super().get_connection(*args, **kwargs)


class AsyncFollowingPool(AsyncSentinelConnectionPool):
    """:class:`FollowingPool` for the asyncio clients."""

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if _due(self):
            with contextlib.suppress(redis.RedisError):
                await self.get_master_address()
        return await super().get_connection(*args, **kwargs)


def sentinel_client(url: str, **kwargs: Any) -> redis.Redis:
    """A client of the master of ``url`` (``redis+sentinel://``); ``kwargs``: connection options
    as for ``redis.Redis`` (timeouts, ``decode_responses``, ...)."""
    parsed = parse_sentinel_url(url)
    sentinel = Sentinel(parsed.sentinels, sentinel_kwargs=parsed.sentinel_kwargs())
    client: redis.Redis = sentinel.master_for(parsed.service, connection_pool_class=FollowingPool,
                                              **parsed.master_kwargs(), **kwargs)
    return client


def async_sentinel_client(url: str, **kwargs: Any) -> aioredis.Redis:
    """:func:`sentinel_client` for asyncio (create it in the event loop that will use it)."""
    parsed = parse_sentinel_url(url)
    sentinel = AsyncSentinel(parsed.sentinels, sentinel_kwargs=parsed.sentinel_kwargs())
    client: aioredis.Redis = sentinel.master_for(parsed.service, connection_pool_class=AsyncFollowingPool,
                                                 **parsed.master_kwargs(), **kwargs)
    return client
