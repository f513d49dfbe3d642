"""The throwaway PKI of the TLS tests (tests/tls_certs.py) verifies, and fails, as promised."""

from __future__ import annotations

import socket
import ssl
import stat
import threading
from pathlib import Path
from typing import Any

import pytest


def _serve_once(cert: Path, key: Path) -> int:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def accept() -> None:
        with listener:
            conn, _ = listener.accept()
            try:
                context.wrap_socket(conn, server_side=True).close()
            except (OSError, ssl.SSLError):
                conn.close()

    threading.Thread(target=accept, daemon=True).start()
    return int(listener.getsockname()[1])


def _connect(port: int, ca: Path, host: str = "127.0.0.1") -> None:
    context = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        context.wrap_socket(sock, server_hostname=host).close()


def test_the_pki_verifies_and_fails_as_documented(pki: Any) -> None:
    for key in (pki.ca_key, pki.server_key, pki.client_key, pki.other_ca_key, pki.expired_server_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    _connect(_serve_once(pki.server_cert, pki.server_key), pki.ca_cert)
    _connect(_serve_once(pki.server_cert, pki.server_key), pki.ca_cert, host="localhost")
    with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer certificate"):
        _connect(_serve_once(pki.server_cert, pki.server_key), pki.other_ca_cert)
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate has expired"):
        _connect(_serve_once(pki.expired_server_cert, pki.expired_server_key), pki.ca_cert)
    client = ssl.create_default_context(cafile=str(pki.ca_cert))
    client.load_cert_chain(pki.client_cert, pki.client_key)  # a usable client identity
