"""uvicorn's HTTP protocols with bounded request heads and errors in the API's JSON shape.

uvicorn answers a request it cannot parse itself, before any ASGI code runs, with a plain-text
``400 Invalid HTTP request received.``; and with httptools (the parser ``uvicorn[standard]``
picks) it reads a request head of any size: a 64 MB header was read and answered 200 (issue 16).
No middleware can change either, as both happen below ASGI, so ``cloverq api`` serves with these
subclasses (``http=`` of uvicorn):

- :class:`JsonHttpToolsProtocol` counts the bytes of each request head as they arrive and its
  header lines, and refuses a head over ``max_header_bytes`` or ``max_header_count`` with
  ``431 headers_too_large`` at once (at most one read, 256 KiB, past the limit is ever buffered);
- it answers parse errors with ``400 bad_request`` in ``{"error": {"code", "message",
  "details"}}``. The body is always cloverq's shape, also on the OpenAI-compatible paths (the
  path of an unparsable request is not known); OpenAI clients read ``error.message`` and
  ``error.code``, which both shapes carry.

httptools comes with ``uvicorn[standard]`` (a dependency), so ``cloverq api`` always serves with
it; uvicorn's h11 protocol (``--http h11`` of plain uvicorn) bounds heads at 16 KiB itself but
still answers in plain text.

It also bounds what idle and slow connections may hold (issue 31: 1,100 idle connections used up
a 1,024 descriptor limit and ``/healthz`` failed; slowloris connections were never closed):

- a new connection that sends nothing for ``idle_timeout_seconds`` is closed (uvicorn's
  keep-alive timer starts only after a first response);
- a request head that has begun must be complete within ``header_timeout_seconds``, or it is
  answered ``408 request_timeout`` and closed (a head trickled byte by byte resets no timer);
- at most ``max_connections`` connections per process: a new connection past it first closes the
  longest-idle ones (no request in flight, nothing received), so idle connections never crowd out
  a request; when every connection is busy, the next ``health_connections`` may only ask
  ``/healthz``, ``/readyz`` or ``/metrics`` (anything else: ``503 too_many_connections``), so
  probes still answer; past both a connection is answered 503 and closed at once, so refused
  connections hold no descriptor.

Limits come from the settings (``CLOVERQ_MAX_HEADER_BYTES``, ``CLOVERQ_MAX_HEADER_COUNT``,
``CLOVERQ_HEADER_TIMEOUT_SECONDS``, ``CLOVERQ_IDLE_TIMEOUT_SECONDS``, ``CLOVERQ_MAX_CONNECTIONS``,
``CLOVERQ_HEALTH_CONNECTIONS``) unless a subclass pins them (tests). Connections are closed after
such an answer.
"""

from __future__ import annotations

import asyncio
import json
import resource
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api.errors import error_body
from scheduler.infra.settings import get_settings

BAD_REQUEST_MESSAGE = "The request is not valid HTTP."
# Served from the health reserve:
HEALTH_PATHS = (b"/healthz", b"/livez", b"/readyz", b"/readyz/replica", b"/metrics")
FD_MARGIN = 64  # descriptors kept for everything but client connections (SQL, Redis, files, logs)
RETRY_AFTER_SECONDS = "1"
EVICTABLE_AFTER_SECONDS = 1.0  # an idle connection younger than this may be a client about to send


class HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head the protocol refuses (over the limits,
    or a non-health request on a connection of the health reserve)."""


def head_limits(max_bytes: int | None, max_count: int | None) -> tuple[int, int]:
    """The limits in force: the pinned values, else the process settings."""
    settings = get_settings()
    return (max_bytes if max_bytes is not None else settings.limits.max_header_bytes,
            max_count if max_count is not None else settings.limits.max_header_count)


def json_error_bytes(status: int, reason: str, code: str, message: str, details: Any,
                     default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A complete HTTP/1.1 error response in the JSON error shape that closes the connection."""
    body = json.dumps(error_body(code, message, details)).encode()
    head = [f"HTTP/1.1 {status} {reason}\r\n".encode()]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head += [b"content-type: application/json\r\n", b"content-length: " + str(len(body)).encode() + b"\r\n",
             b"connection: close\r\n", b"\r\n"]
    return b"".join(head) + body


def too_large_details(max_bytes: int, max_count: int) -> dict[str, int]:
    return {"max_header_bytes": max_bytes, "max_header_count": max_count}


def raise_descriptor_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65_536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # keep the soft limit; connection_limits fits the cap to it
    return soft


def connection_limits(max_connections: int, health_connections: int, descriptors: int) -> tuple[int, int]:
    """``(max_connections, health_connections)`` that fit in ``descriptors`` open files: every
    connection holds one, and ``FD_MARGIN`` stay for the process's own files and clients."""
    room = max(2, descriptors - FD_MARGIN)
    health = min(health_connections, max(1, room // 10))
    return min(max_connections, room - health), health


def connection_timeouts(header: float | None, idle: float | None) -> tuple[float, float]:
    settings = get_settings()
    return (header if header is not None else settings.limits.header_timeout_seconds,
            idle if idle is not None else settings.limits.idle_timeout_seconds)


class JsonHttpToolsProtocol(HttpToolsProtocol):
    """httptools with bounded request heads and JSON errors (see the module docstring)."""

    max_header_bytes: int | None = None  # None: the settings' value
    max_header_count: int | None = None
    header_timeout_seconds: float | None = None
    idle_timeout_seconds: float | None = None
    max_connections: int | None = None
    health_connections: int | None = None
    _limits: tuple[int, int] | None = None  # per class: fitted to the descriptor limit once

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._max_bytes, self._max_count = head_limits(self.max_header_bytes, self.max_header_count)
        self._header_timeout, self._idle_timeout = connection_timeouts(self.header_timeout_seconds,
                                                                       self.idle_timeout_seconds)
        self._max_connections, self._health_connections = self._connection_limits()
        self._health_only = False  # a connection of the health reserve
        self._connection_refused = False
        self._evicted = False  # closed to make room for a newer connection
        self._idle_since = 0.0  # loop time since which it has had no request
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_head = True  # reading a request head (no on_headers_complete yet)
        self._head_bytes = 0  # bytes received while in the head (a head still arriving)
        self._head_size = 0  # bytes of the parsed request target and header lines
        self._head_lines = 0
        self._head_refused = False

    @classmethod
    def _connection_limits(cls) -> tuple[int, int]:
        if cls._limits is None:
            settings = get_settings()
            limits = settings.limits
            most = cls.max_connections if cls.max_connections is not None else limits.max_connections
            health = limits.health_connections if cls.health_connections is None else cls.health_connections
            cls._limits = connection_limits(most, health, raise_descriptor_limit())
        return cls._limits

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._idle_since = self.loop.time()
        self._evicted = False
        if len(self.connections) > self._max_connections:  # this one included
            open_now = self._make_room()
            if open_now > self._max_connections + self._health_connections:
                self._refuse_connection()
                return
            self._health_only = open_now > self._max_connections
        self._start_head_timer(self._idle_timeout, idle=True)

    def _is_idle(self, now: float) -> bool:
        """Between requests with nothing received for a while: closing it loses no request."""
        cycle = self.cycle
        return (not self._evicted and self._in_head and self._head_bytes == 0
                and now - self._idle_since >= EVICTABLE_AFTER_SECONDS
                and (cycle is None or cycle.response_complete) and not self.transport.is_closing())

    def _make_room(self) -> int:
        """Over the cap: close the longest-idle connections (never this one) until this one fits;
        returns the connections still open without those. Idle connections must not crowd out a
        request, a probe above all (1,100 idle ones made ``/healthz`` fail, issue 31)."""
        others = [c for c in self.connections if c is not self and isinstance(c, JsonHttpToolsProtocol)]
        open_now = 1 + sum(1 for c in others if not c._evicted)
        now = self.loop.time()
        idle = sorted((c for c in others if c._is_idle(now)), key=lambda c: c._idle_since)
        for victim in idle[:max(0, open_now - self._max_connections)]:
            victim._evicted = True
            victim._stop_head_timer()
            victim.transport.close()
            open_now -= 1
        return open_now

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _start_head_timer(self, seconds: float, *, idle: bool) -> None:
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(seconds, self._head_timed_out, idle)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self, idle: bool) -> None:
        """No first byte in time (close), or a head not complete in time (408, then close)."""
        self._head_timer = None
        if self.transport.is_closing():
            return
        if idle:
            self.transport.close()
            return
        message = f"The request head did not arrive within {self._header_timeout:g} seconds."
        self._write_and_close(json_error_bytes(408, "Request Timeout", "request_timeout", message,
                                               {"header_timeout_seconds": self._header_timeout},
                                               self.server_state.default_headers))

    def _refuse_connection(self) -> None:
        message = (f"This API process serves at most {self._max_connections} connections; "
                   "try again shortly.")
        self.logger.warning("Connection refused: %d open, at most %d (+%d for health).",
                            len(self.connections), self._max_connections, self._health_connections)
        self._write_and_close(json_error_bytes(
            503, "Service Unavailable", "too_many_connections", message,
            {"max_connections": self._max_connections},
            [*self.server_state.default_headers, (b"retry-after", RETRY_AFTER_SECONDS.encode())]))

    def data_received(self, data: bytes) -> None:
        """Count the head's bytes as they come; refuse it once past the limit (it is still being
        read after this chunk was parsed), rather than let the parser buffer it whole."""
        if self._in_head:
            if self._head_bytes == 0 and data:  # the head began: its own deadline from now on
                self._start_head_timer(self._header_timeout, idle=False)
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self._max_bytes and not self.transport.is_closing():
            self._refuse_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        self._check_head()
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_lines += 1
        self._head_size += len(name) + len(value) + 4  # ": " and CRLF
        self._check_head()
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._check_head()  # a whole over-large head that arrived in one read
        self._in_head = False
        self._stop_head_timer()
        if self._health_only and self.url.split(b"?", 1)[0] not in HEALTH_PATHS:
            self._connection_refused = True  # the health reserve serves probes only
            raise HeadTooLarge  # stops the parser; uvicorn answers through send_400_response
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._idle_since = self.loop.time()
        self._in_head = True  # keep-alive: the next head has its own budget
        self._head_bytes = self._head_size = self._head_lines = 0

    def _check_head(self) -> None:
        """Stop parsing a head over the limits (httptools raises HttpParserCallbackError, which
        uvicorn answers through :meth:`send_400_response`)."""
        if self._head_size > self._max_bytes or self._head_lines > self._max_count:
            self._head_refused = True
            raise HeadTooLarge

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a parse error (our limit's callback error arrives here too)."""
        if self._connection_refused:
            self._refuse_connection()
            return
        if self._head_refused:
            self._refuse_head()
            return
        self._write_and_close(json_error_bytes(400, "Bad Request", "bad_request", BAD_REQUEST_MESSAGE,
                                               None, self.server_state.default_headers))

    def _refuse_head(self) -> None:
        self.logger.warning("Request head over the limits (%d bytes, %d header lines max).",
                            self._max_bytes, self._max_count)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            self.transport.close()  # a pipelined head while a response is under way: just close
            return
        message = (f"The request head is larger than {self._max_bytes} bytes or has more than "
                   f"{self._max_count} header lines.")
        self._write_and_close(json_error_bytes(431, "Request Header Fields Too Large", "headers_too_large",
                                               message, too_large_details(self._max_bytes, self._max_count),
                                               self.server_state.default_headers))

    def _write_and_close(self, response: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(response)
            self.transport.close()
