"""API keys: format, hashing, scopes, authentication, the per-process cache, the dev key."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session, sessionmaker

from scheduler.access.api_keys import (
    ALL_SCOPES,
    DEV_KEY_FILE,
    ApiKey,
    InvalidKeyRequest,
    KeyAuthenticator,
    create_key,
    ensure_dev_key,
    hash_key,
    list_keys,
    parse_key,
    parse_scopes,
    revoke_key,
)


@pytest.fixture
def sessions(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    """The key table alone on a SQLite file (the real schema comes from Alembic elsewhere)."""
    engine = create_engine(f"sqlite:///{tmp_path / 'keys.db'}")
    ApiKey.__table__.create(engine)
    yield sessionmaker(engine, expire_on_commit=False)
    engine.dispose()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_key_format_and_only_a_hash_is_stored(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        created = create_key(session, tenant="acme", scopes=["read"])
        row = session.scalars(select(ApiKey)).one()
    key_id, secret = parse_key(created.key) or ("", "")
    assert created.key == f"cq_{key_id}_{secret}" and key_id == created.info.key_id
    assert len(secret) >= 40  # 32 random bytes, url-safe base64
    assert row.key_hash == hashlib.sha256(f"{key_id}:{secret}".encode()).hexdigest()
    stored = " ".join(str(getattr(row, column.key)) for column in ApiKey.__table__.columns)
    assert secret not in stored and created.key not in stored


def test_parse_key_rejects_malformed_keys() -> None:
    assert parse_key("cq_0123456789ab_" + "A" * 43) == ("0123456789ab", "A" * 43)
    for bad in (
        "",
        "cq_",
        "cq_0123456789ab",
        "cq_XYZ456789ab_" + "A" * 43,
        "xx_0123456789ab_" + "A" * 43,
        "cq_0123456789ab_short",
        "cq_0123456789ab_" + "A" * 43 + " ",
    ):
        assert parse_key(bad) is None


def test_hash_binds_the_key_id() -> None:
    assert hash_key("aaaaaaaaaaaa", "s" * 43) != hash_key("bbbbbbbbbbbb", "s" * 43)


def test_scopes_are_validated() -> None:
    assert parse_scopes("submit,read") == {"submit", "read"}
    assert parse_scopes(" admin ") == {"admin"}
    with pytest.raises(InvalidKeyRequest, match="unknown scope"):
        parse_scopes("read,root")
    with pytest.raises(InvalidKeyRequest, match="at least one"):
        parse_scopes(",")


def test_tenant_names_are_validated(sessions: sessionmaker[Session]) -> None:
    with sessions() as session, pytest.raises(InvalidKeyRequest, match="tenant"):
        create_key(session, tenant="bad tenant/../", scopes=["read"])


def test_authenticate_known_forged_and_revoked(sessions: sessionmaker[Session]) -> None:
    auth = KeyAuthenticator(sessions, cache_seconds=0)
    with sessions() as session:
        created = create_key(session, tenant="acme", scopes=["read", "submit"], label="ci")
    info = auth.authenticate(created.key)
    assert info is not None and info.tenant == "acme" and info.scopes == {"read", "submit"}
    forged = created.key[:-1] + ("A" if created.key[-1] != "A" else "B")
    assert auth.authenticate(forged) is None
    assert auth.authenticate("cq_ffffffffffff_" + "A" * 43) is None  # unknown id
    assert auth.authenticate("garbage") is None
    with sessions() as session:
        revoked = revoke_key(session, key_id=created.info.key_id)
    assert revoked is not None and revoked.revoked and revoked.revoked_at is not None
    assert auth.authenticate(created.key) is None
    with sessions() as session:
        assert revoke_key(session, key_id="000000000000") is None


def test_cache_bounds_how_long_a_revocation_takes(sessions: sessionmaker[Session]) -> None:
    clock = FakeClock()
    auth = KeyAuthenticator(sessions, cache_seconds=5.0, clock=clock)
    with sessions() as session:
        created = create_key(session, tenant="acme", scopes=["read"])
    assert auth.authenticate(created.key) is not None
    with sessions() as session:
        revoke_key(session, key_id=created.info.key_id)
    clock.now += 4.9
    assert auth.authenticate(created.key) is not None  # still cached in this process
    clock.now += 0.2
    assert auth.authenticate(created.key) is None  # the TTL passed: looked up again
    auth.forget(created.info.key_id)


def test_forget_drops_a_cached_key(sessions: sessionmaker[Session]) -> None:
    auth = KeyAuthenticator(sessions, cache_seconds=60.0, clock=FakeClock())
    with sessions() as session:
        created = create_key(session, tenant="acme", scopes=["read"])
    assert auth.authenticate(created.key) is not None
    with sessions() as session:
        revoke_key(session, key_id=created.info.key_id)
    auth.forget(created.info.key_id)
    assert auth.authenticate(created.key) is None


def test_a_flood_of_fresh_bogus_key_ids_costs_a_bounded_number_of_queries(
    sessions: sessionmaker[Session],
) -> None:
    """Issue 16: each fresh key-shaped id cost one SQL lookup (188/s); the cache of unknown ids
    cannot help when every id is new."""
    from sqlalchemy import event

    clock = FakeClock()
    auth = KeyAuthenticator(sessions, cache_seconds=5.0, clock=clock, unknown_lookups_per_second=3)
    with sessions() as session:
        existing = create_key(session, tenant="acme", scopes=["read"])
    queries: list[str] = []
    event.listen(sessions.kw["bind"], "before_cursor_execute",
                 lambda _c, _cur, statement, *_: queries.append(statement))
    bogus = [f"cq_{i:012x}_{'s' * 43}" for i in range(1, 201)]
    assert all(auth.authenticate(key) is None for key in bogus)
    assert len(queries) == 3 + 1  # the budget's lookups, then one snapshot of the key ids
    assert auth.authenticate(existing.key) is not None  # a real key still works mid-flood
    with sessions() as session:
        fresh = create_key(session, tenant="acme", scopes=["read"])  # e.g. by another process
    assert auth.authenticate(fresh.key) is None  # the snapshot is younger than its interval
    clock.now += 1.0
    assert all(auth.authenticate(key) is None for key in bogus[:50])  # still bounded
    assert auth.authenticate(fresh.key) is not None  # within one snapshot interval
    assert len(queries) < 20


def test_list_keys_filters(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        a = create_key(session, tenant="a", scopes=["read"])
        create_key(session, tenant="b", scopes=["read"])
        revoke_key(session, key_id=a.info.key_id)
        assert {info.tenant for info in list_keys(session)} == {"a", "b"}
        assert [info.tenant for info in list_keys(session, tenant="a")] == ["a"]
        assert [info.tenant for info in list_keys(session, include_revoked=False)] == ["b"]


def test_dev_key_is_reused_while_valid_and_replaced_when_revoked(
    sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    first = ensure_dev_key(sessions, data_dir=tmp_path)
    assert ensure_dev_key(sessions, data_dir=tmp_path) == first
    assert (tmp_path / DEV_KEY_FILE).stat().st_mode & 0o777 == 0o600
    info = KeyAuthenticator(sessions, cache_seconds=0).authenticate(first)
    assert info is not None and info.tenant == "default" and info.scopes == ALL_SCOPES
    with sessions() as session:
        revoke_key(session, key_id=info.key_id)
    second = ensure_dev_key(sessions, data_dir=tmp_path)
    assert second != first
    assert (tmp_path / DEV_KEY_FILE).read_text().strip() == second
