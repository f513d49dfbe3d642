"""uvicorn's own answers under ``cloverq api``'s protocol (issue 16): bounded request heads and JSON.

A 64 MB header was read whole and answered 200, and unparsable requests got uvicorn's plain-text
400. A real uvicorn on loopback serves a trivial app with :class:`JsonHttpToolsProtocol` (small
pinned limits) and raw sockets speak to it, since an HTTP client library would refuse to send
what these requests hold.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from api.http_protocol import JsonHttpToolsProtocol
from tests.conftest import free_port

pytestmark = pytest.mark.integration


class SmallHeads(JsonHttpToolsProtocol):
    max_header_bytes = 4096
    max_header_count = 20


async def _ok_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def serve_ok_app(protocol: type[JsonHttpToolsProtocol]) -> Iterator[int]:
    """A real uvicorn on loopback serving ``_ok_app`` with ``protocol``; yields its port."""
    port = free_port()
    config = uvicorn.Config(_ok_app, host="127.0.0.1", port=port, http=protocol, lifespan="off",
                            log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    yield from serve_ok_app(SmallHeads)


def _exchange(port: int, *chunks: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``chunks`` (stopping when the server closes), then read the answer to the end."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            for chunk in chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed while we were still sending: what we want
        answer = b""
        try:
            while data := sock.recv(65536):
                answer += data
        except ConnectionResetError:
            pass
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
    return int(status_line.split()[1]), headers, body


def test_a_huge_header_is_refused_with_431_json_before_it_is_read(port: int) -> None:
    started = time.monotonic()
    status, headers, body = _exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ",
                                      *([b"a" * 65536] * 1024), b"\r\n\r\n")  # 64 MiB offered
    assert time.monotonic() - started < 5
    assert status == 431 and headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["code"] == "headers_too_large"
    assert error["details"] == {"max_header_bytes": 4096, "max_header_count": 20}


def test_an_over_large_head_that_arrives_in_one_read_is_refused_too(port: int) -> None:
    status, _, body = _exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
    assert status == 431 and json.loads(body)["error"]["code"] == "headers_too_large"


def test_too_many_header_lines_are_refused_with_431_json(port: int) -> None:
    lines = b"".join(b"X-H%d: v\r\n" % i for i in range(21))
    status, _, body = _exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n")
    assert status == 431 and json.loads(body)["error"]["code"] == "headers_too_large"


def test_an_unparsable_request_gets_a_json_400(port: int) -> None:
    status, headers, body = _exchange(port, b"NOT HTTP AT ALL\x00\r\n\r\n")
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.loads(body) == {"error": {"code": "bad_request", "message": "The request is not valid HTTP.",
                                          "details": None}}


def test_ordinary_requests_pass_and_the_budget_is_per_request(port: int) -> None:
    request = b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"p" * 3000 + b"\r\n\r\n"
    last = request.replace(b"Host: x", b"Host: x\r\nConnection: close")
    # Three 3 kB heads on one keep-alive connection: each within 4 kB, together over it.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request + request + last)
        answer = b""
        while data := sock.recv(65536):
            answer += data
    assert answer.count(b"HTTP/1.1 200 OK") == 3
