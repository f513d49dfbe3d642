"""A throwaway PKI for TLS tests, made with the ``openssl`` command-line tool.

``make_pki(directory)`` writes, in about a tenth of a second (EC P-256 keys):

- ``ca_cert`` / ``ca_key``: the test CA every other certificate below is signed by;
- ``server_cert`` / ``server_key``: a server certificate (``serverAuth``) valid for
  ``DNS:localhost``, ``IP:127.0.0.1`` and ``IP:::1``;
- ``client_cert`` / ``client_key``: a client certificate (``clientAuth``, CN ``cloverq-client``);
- ``other_ca_cert`` / ``other_ca_key``: an unrelated CA, for "wrong CA" tests (a client that
  trusts only this CA refuses ``server_cert``);
- ``expired_server_cert`` / ``expired_server_key``: like the server certificate, signed by the CA,
  but its ``notAfter`` lies in the past (verification fails with "certificate has expired").

Keys are written with mode 0600, certificates 0644. The session fixture ``pki`` (tests/conftest.py)
makes one PKI per test session; use ``make_pki`` directly for a PKI of your own.

The ``cryptography`` package is not a dependency of this project, so the ``openssl`` binary is used
(it is part of every Debian/Ubuntu base image); ``openssl_missing()`` says why when it is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVER_SAN = "DNS:localhost,IP:127.0.0.1,IP:::1"
VALID_DAYS = 30


@dataclass(frozen=True)
class Pki:
    directory: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca_cert: Path
    other_ca_key: Path
    expired_server_cert: Path
    expired_server_key: Path


def openssl_missing() -> str | None:
    """A skip reason when the ``openssl`` binary is not on PATH, else None."""
    if shutil.which("openssl") is None:
        return "the openssl command-line tool is not installed (apt-get install openssl)"
    return None


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")


def _key(path: Path) -> Path:
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(path), cwd=path.parent)
    os.chmod(path, 0o600)
    return path


def _ca(directory: Path, name: str, common_name: str) -> tuple[Path, Path]:
    key = _key(directory / f"{name}.key")
    cert = directory / f"{name}.pem"
    _openssl("req", "-x509", "-new", "-key", str(key), "-subj", f"/CN={common_name}",
             "-days", str(VALID_DAYS), "-sha256", "-out", str(cert),
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-addext", "subjectKeyIdentifier=hash",
             cwd=directory)
    os.chmod(cert, 0o644)
    return cert, key


def _leaf(directory: Path, name: str, common_name: str, extensions: str, *,
          ca_cert: Path, ca_key: Path, days: int) -> tuple[Path, Path]:
    key = _key(directory / f"{name}.key")
    csr = directory / f"{name}.csr"
    ext = directory / f"{name}.ext"
    cert = directory / f"{name}.pem"
    ext.write_text(extensions)
    _openssl("req", "-new", "-key", str(key), "-subj", f"/CN={common_name}", "-out", str(csr), cwd=directory)
    # ``-days -1`` gives notBefore = now and notAfter = now - 1 day: a certificate that has expired
    # (OpenSSL 3.0's x509 has no -not_before; ``openssl ca`` would need a whole CA database).
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
             "-CAcreateserial", "-days", str(days), "-sha256", "-extfile", str(ext), "-out", str(cert),
             cwd=directory)
    csr.unlink()
    ext.unlink()
    os.chmod(cert, 0o644)
    return cert, key


def make_pki(directory: Path) -> Pki:
    """Generate a fresh CA, server, client, unrelated-CA and expired-server certificate in
    ``directory`` (created if missing)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _ca(directory, "ca", "cloverq test CA")
    other_ca_cert, other_ca_key = _ca(directory, "other-ca", "unrelated test CA")
    common = "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
    server_ext = f"{common}extendedKeyUsage=serverAuth\nsubjectAltName={SERVER_SAN}\n"
    server_cert, server_key = _leaf(directory, "server", "localhost", server_ext,
                                    ca_cert=ca_cert, ca_key=ca_key, days=VALID_DAYS)
    client_cert, client_key = _leaf(directory, "client", "cloverq-client",
                                    f"{common}extendedKeyUsage=clientAuth\n",
                                    ca_cert=ca_cert, ca_key=ca_key, days=VALID_DAYS)
    expired_cert, expired_key = _leaf(directory, "expired-server", "localhost", server_ext,
                                      ca_cert=ca_cert, ca_key=ca_key, days=-1)
    return Pki(directory=directory, ca_cert=ca_cert, ca_key=ca_key,
               server_cert=server_cert, server_key=server_key,
               client_cert=client_cert, client_key=client_key,
               other_ca_cert=other_ca_cert, other_ca_key=other_ca_key,
               expired_server_cert=expired_cert, expired_server_key=expired_key)
