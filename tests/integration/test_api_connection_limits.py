"""Idle, slow and too many connections under ``cloverq api``'s protocol (issue 31).

500 idle connections stayed open for 30 s, 100 slowloris connections for 40 s, and 1,100 idle
connections used up a 1,024 descriptor limit so that ``/healthz`` failed. A real uvicorn on
loopback serves a trivial app with :class:`JsonHttpToolsProtocol` (small pinned limits), and raw
sockets play the idle, slow and crowding clients.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from api.http_protocol import JsonHttpToolsProtocol, connection_limits
from tests.integration.test_api_http_protocol import serve_ok_app

pytestmark = pytest.mark.integration


class QuickTimeouts(JsonHttpToolsProtocol):
    header_timeout_seconds = 0.5
    idle_timeout_seconds = 0.5


class FewConnections(JsonHttpToolsProtocol):
    max_connections = 10
    health_connections = 3


@pytest.fixture(scope="module")
def quick_port() -> Iterator[int]:
    yield from serve_ok_app(QuickTimeouts)


@pytest.fixture(scope="module")
def crowded_port() -> Iterator[int]:
    yield from serve_ok_app(FewConnections)


def _read_all(sock: socket.socket) -> bytes:
    answer = b""
    try:
        while data := sock.recv(65536):
            answer += data
    except (ConnectionResetError, TimeoutError):
        pass
    return answer


def _status(answer: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body) if body.startswith(b"{") else {}


def test_a_silent_connection_is_closed_after_the_idle_timeout(quick_port: int) -> None:
    with socket.create_connection(("127.0.0.1", quick_port), timeout=5) as sock:
        started = time.monotonic()
        assert _read_all(sock) == b""  # closed by the server, nothing said
        assert 0.4 < time.monotonic() - started < 3.0


def test_a_head_trickled_byte_by_byte_gets_408_within_the_header_timeout(quick_port: int) -> None:
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    with socket.create_connection(("127.0.0.1", quick_port), timeout=5) as sock:
        started = time.monotonic()
        try:
            for byte in head:  # one byte every 20 ms: 4 s for the whole head
                sock.sendall(bytes([byte]))
                time.sleep(0.02)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = _read_all(sock)
        assert time.monotonic() - started < 3.0
    status, body = _status(answer)
    assert status == 408 and body["error"]["code"] == "request_timeout"


def test_a_prompt_request_on_the_same_server_is_served(quick_port: int) -> None:
    with socket.create_connection(("127.0.0.1", quick_port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _status(_read_all(sock))[0] == 200


def _get(sock: socket.socket, path: str) -> tuple[int, dict[str, Any]]:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    return _status(_read_all(sock))


def test_idle_connections_make_room_for_new_ones(crowded_port: int) -> None:
    """1,100 idle connections made /healthz fail: past the cap the longest-idle one is closed."""
    address = ("127.0.0.1", crowded_port)
    with ExitStack() as held:
        idle = [held.enter_context(socket.create_connection(address, timeout=5)) for _ in range(15)]
        time.sleep(1.2)  # idle for longer than a client about to send
        with socket.create_connection(address, timeout=5) as sock:
            assert _get(sock, "/healthz")[0] == 200
        with socket.create_connection(address, timeout=5) as sock:
            assert _get(sock, "/v1/jobs")[0] == 200  # not only probes: any request is served
        for sock in idle[:5]:  # the oldest ones made room
            assert _read_all(sock) == b""


def test_past_the_cap_of_busy_connections_health_answers_and_the_rest_is_refused(crowded_port: int) -> None:
    address = ("127.0.0.1", crowded_port)
    with ExitStack() as held:
        busy = [held.enter_context(socket.create_connection(address, timeout=5)) for _ in range(10)]
        for sock in busy:  # each in the middle of a request head: nothing to close
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.3)
        reserve = [held.enter_context(socket.create_connection(address, timeout=5)) for _ in range(3)]
        time.sleep(0.2)
        assert _get(reserve[0], "/healthz")[0] == 200  # probes keep answering from the reserve
        assert _get(reserve[1], "/readyz?x=1")[0] == 200
        status, body = _get(reserve[2], "/v1/jobs")
        assert status == 503 and body["error"]["code"] == "too_many_connections"
        time.sleep(0.2)  # the reserve's connections are closed again
        extra = [held.enter_context(socket.create_connection(address, timeout=5)) for _ in range(3)]
        for sock in extra:
            sock.sendall(b"GET / HTTP/1.1\r\n")
        time.sleep(0.2)
        beyond = held.enter_context(socket.create_connection(address, timeout=5))
        status, body = _status(_read_all(beyond))  # refused as it connects: no request needed
        assert status == 503 and body["error"]["details"] == {"max_connections": 10}
        for sock in busy:  # the busy ones are still being served
            sock.sendall(b"Connection: close\r\n\r\n")
            assert _status(_read_all(sock))[0] == 200
    with socket.create_connection(address, timeout=5) as sock:  # the crowd left: served again
        assert _get(sock, "/v1/jobs")[0] == 200


def test_the_cap_fits_the_descriptor_limit() -> None:
    assert connection_limits(900, 32, 1024) == (900, 32)  # 1024 - 64 kept: room for 960
    assert connection_limits(2000, 32, 1024) == (928, 32)  # the 1,024 limit: health fits in
    assert connection_limits(900, 32, 256) == (173, 19)
    assert connection_limits(5, 2, 65536) == (5, 2)
