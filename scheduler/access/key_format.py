"""What an API key looks like: its format, the patterns that find one, and the digest stored of it.

Key format: ``cloverq_<key_id>_<secret>`` (keys made before the ``cloverq_`` prefix, ``cq_<key_id>_<secret>``,
keep working: both are parsed).

- ``cloverq_`` is distinctive on purpose: a secret scanner finds leaked keys with
  :data:`SCANNER_REGEX` (docs/security.md) without matching ordinary identifiers.
- ``key_id`` (12 hex chars) is not secret: it is the primary key, so authentication is one
  lookup by id (never a scan comparing hashes) and logs / audit lines can name a key safely.
- ``secret`` is 32 random bytes (``secrets.token_urlsafe``): 256 bits of entropy.

We store ``sha256("<key_id>:<secret>")``. A slow password hash (bcrypt, argon2) exists to
make guessing *low-entropy human passwords* expensive; a 256-bit random secret cannot be
guessed at any hash speed, so a fast hash loses nothing and keeps the per-request check
cheap. Binding the id into the hash means a stolen hash row cannot be replayed under another
id. The stored and computed digests are compared with ``hmac.compare_digest`` (constant time,
``key_authenticator.py``).
"""

from __future__ import annotations

import hashlib
import re

KEY_PREFIX = "cloverq"  # new keys: cloverq_<key_id>_<secret>
LEGACY_KEY_PREFIX = "cq"  # keys made before the cloverq_ prefix; still accepted
KEY_PATTERN = re.compile(
    r"^(?:cloverq|cq)_(?P<key_id>[0-9a-f]{12})_(?P<secret>[A-Za-z0-9_\-]{20,128})$")
# Anything that looks like one of our keys (either prefix), wherever it appears in a string (log
# redaction keeps ``visible``, the prefix and the key id, and masks the rest).
KEY_SEARCH_PATTERN = re.compile(r"(?P<visible>(?:cloverq|cq)_[0-9a-f]{12})_[A-Za-z0-9_\-]{20,128}")
# For secret scanners (docs/security.md): a key made now, and nothing else, wherever it appears.
SCANNER_REGEX = r"(?<![A-Za-z0-9_])cloverq_[0-9a-f]{12}_[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])"
_KEY_ID_PREFIX = re.compile(r"^(?:cloverq|cq)_(?P<key_id>[0-9a-f]{12})(?:_|$)")


def hash_key(key_id: str, secret: str) -> str:
    """The stored digest of a key (see the module docstring for why sha256 suffices)."""
    return hashlib.sha256(f"{key_id}:{secret}".encode()).hexdigest()


def parse_key(key: str) -> tuple[str, str] | None:
    """``(key_id, secret)`` of a well-formed key (``cloverq_`` or legacy ``cq_``), else None."""
    match = KEY_PATTERN.match(key)
    if match is None:
        return None
    return match.group("key_id"), match.group("secret")


def key_id_of(text: str) -> str:
    """The key id in ``text``: a whole key, ``cloverq_<id>`` / ``cq_<id>``, or the id itself (as is)."""
    match = _KEY_ID_PREFIX.match(text.strip())
    return match.group("key_id") if match else text.strip()
