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

Limits come from the settings (``CLOVERQ_MAX_HEADER_BYTES``, ``CLOVERQ_MAX_HEADER_COUNT``) unless a
subclass pins them (tests). Connections are closed after such an answer.
"""

from __future__ import annotations

import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api.errors import error_body
from scheduler.settings import get_settings

BAD_REQUEST_MESSAGE = "The request is not valid HTTP."


class HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head over the limits."""


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


class JsonHttpToolsProtocol(HttpToolsProtocol):
    """httptools with bounded request heads and JSON errors (see the module docstring)."""

    max_header_bytes: int | None = None  # None: the settings' value
    max_header_count: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._max_bytes, self._max_count = head_limits(self.max_header_bytes, self.max_header_count)
        self._in_head = True  # reading a request head (no on_headers_complete yet)
        self._head_bytes = 0  # bytes received while in the head (a head still arriving)
        self._head_size = 0  # bytes of the parsed request target and header lines
        self._head_lines = 0
        self._head_refused = False

    def data_received(self, data: bytes) -> None:
        """Count the head's bytes as they come; refuse it once past the limit (it is still being
        read after this chunk was parsed), rather than let the parser buffer it whole."""
        if self._in_head:
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
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
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
