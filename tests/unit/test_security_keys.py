"""API keys: format, hashing, scopes, authentication, the per-process cache, the dev key; networks,
rotation with overlap and last use (issue 28)."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select, update
from sqlalchemy.orm import Session, sessionmaker

from cli.keys import parse_duration
from scheduler.access.api_keys import (
    ALL_SCOPES,
    MAX_ROTATION_OVERLAP_SECONDS,
    ApiKey,
    InvalidKeyRequest,
    KeyInfo,
    KeyNotFound,
    KeyNotRotatable,
    create_key,
    list_keys,
    parse_scopes,
    revoke_key,
    rotate_key,
    set_key_networks,
)
from scheduler.access.dev_key import DEV_KEY_FILE, ensure_dev_key
from scheduler.access.key_authenticator import KeyAuthenticator, KeyRefusal
from scheduler.access.key_format import SCANNER_REGEX, hash_key, key_id_of, parse_key
from scheduler.observability.redaction import redact_text


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
    assert created.key == f"cloverq_{key_id}_{secret}" and key_id == created.info.key_id
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


# --- issue 28: prefix, networks, rotation with overlap, last use -----------------------------------


class WallClock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_both_prefixes_parse_and_only_new_keys_match_the_scanner_regex() -> None:
    secret = "A" * 43
    assert parse_key(f"cloverq_0123456789ab_{secret}") == ("0123456789ab", secret)
    assert parse_key(f"cq_0123456789ab_{secret}") == ("0123456789ab", secret)  # made before the prefix
    assert parse_key(f"clover_0123456789ab_{secret}") is None
    assert [key_id_of(text) for text in (f"cloverq_0123456789ab_{secret}", "cq_0123456789ab",
                                         " 0123456789ab ")] == ["0123456789ab"] * 3
    scanner = re.compile(SCANNER_REGEX)
    assert scanner.search(f'API_KEY="cloverq_0123456789ab_{"x-_" * 14}y"') is not None
    for text in (f"cq_0123456789ab_{secret}", f"mycloverq_0123456789ab_{secret}",
                 f"cloverq_0123456789ab_{secret}B", "cloverq_jobs_submitted_total"):
        assert scanner.search(text) is None, text
    masked = redact_text(f"auth failed for cloverq_0123456789ab_{secret} and cq_ba9876543210_{secret}")
    assert secret not in masked and "cloverq_0123456789ab_[redacted]" in masked
    assert "cq_ba9876543210_[redacted]" in masked


def test_networks_are_validated_normalised_and_parsed_once(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        created = create_key(session, tenant="acme", scopes=["read"],
                             allowed_networks=["10.1.2.3/8", "127.0.0.2", "10.0.0.0/8"])
        with pytest.raises(InvalidKeyRequest, match="invalid network"):
            create_key(session, tenant="acme", scopes=["read"], allowed_networks=["10.0.0.0/33"])
        row = session.get(ApiKey, created.info.key_id)
        assert row is not None and row.allowed_networks == "10.0.0.0/8 127.0.0.2/32"
        assert created.info.networks == ["10.0.0.0/8", "127.0.0.2/32"]
        assert all(not isinstance(n, str) for n in created.info.allowed_networks)  # parsed objects
        assert set_key_networks(session, key_id=created.info.key_id, allowed_networks=[]).networks == []
        with pytest.raises(KeyNotFound):
            set_key_networks(session, key_id="000000000000", allowed_networks=["10.0.0.0/8"])
        with pytest.raises(InvalidKeyRequest):
            set_key_networks(session, key_id=created.info.key_id, allowed_networks=["nope"])


def test_rotation_overlap_is_enforced_on_every_use_of_a_cached_key(sessions: sessionmaker[Session]) -> None:
    wall = WallClock()
    auth = KeyAuthenticator(sessions, cache_seconds=3600.0, clock=FakeClock(), wall_clock=wall)
    with sessions() as session:
        old = create_key(session, tenant="acme", scopes=["read", "submit"], label="ci",
                         allowed_networks=["127.0.0.0/8"])
        rotated = rotate_key(session, key_id=old.info.key_id, overlap_seconds=60)
    new = rotated.successor
    assert new.key.startswith("cloverq_") and new.info.rotated_from == old.info.key_id
    assert (new.info.tenant, new.info.scopes, new.info.label, new.info.networks) == \
        ("acme", {"read", "submit"}, "ci", ["127.0.0.0/8"])
    assert rotated.previous.expires_at is not None and rotated.previous.state() == "rotating"
    assert isinstance(auth.check(old.key), KeyInfo) and isinstance(auth.check(new.key), KeyInfo)
    wall.now = rotated.previous.expires_at.timestamp() + 0.001  # the cached entry is still fresh
    assert auth.check_cached(old.key) is KeyRefusal.EXPIRED and auth.check(old.key) is KeyRefusal.EXPIRED
    assert auth.authenticate(old.key) is None and isinstance(auth.check_cached(new.key), KeyInfo)
    forged = old.key[:-1] + ("A" if old.key[-1] != "A" else "B")
    assert auth.check(forged) is KeyRefusal.INVALID  # "expired" is told only to the right secret


def test_only_an_active_key_rotates_and_the_overlap_is_bounded(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        key = create_key(session, tenant="acme", scopes=["read"]).info.key_id
        for overlap in (-1, MAX_ROTATION_OVERLAP_SECONDS + 1):
            with pytest.raises(InvalidKeyRequest, match="overlap"):
                rotate_key(session, key_id=key, overlap_seconds=overlap)
        with pytest.raises(KeyNotFound):
            rotate_key(session, key_id="000000000000", overlap_seconds=0)
        rotate_key(session, key_id=key, overlap_seconds=3600)
        with pytest.raises(KeyNotRotatable, match="rotated already"):
            rotate_key(session, key_id=key, overlap_seconds=0)  # one successor per key
        ended = rotate_key(session, key_id=create_key(session, tenant="acme").info.key_id, overlap_seconds=0)
        assert ended.previous.state() == "revoked" and ended.previous.expires_at is not None  # ends now
        with pytest.raises(KeyNotRotatable, match="revoked"):
            rotate_key(session, key_id=ended.previous.key_id, overlap_seconds=10)
        expired = rotate_key(session, key_id=ended.successor.info.key_id, overlap_seconds=1).previous
        session.execute(update(ApiKey).where(ApiKey.key_id == expired.key_id)
                        .values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
        session.commit()
        with pytest.raises(KeyNotRotatable, match="expired"):
            rotate_key(session, key_id=expired.key_id, overlap_seconds=10)


def test_last_use_is_written_in_the_background_at_most_once_per_interval(
    sessions: sessionmaker[Session],
) -> None:
    from sqlalchemy import event

    wall = WallClock()
    auth = KeyAuthenticator(sessions, cache_seconds=5.0, wall_clock=wall, last_used_flush_seconds=3600)
    with sessions() as session:
        key_id = create_key(session, tenant="acme", scopes=["read"]).info.key_id
    writes: list[str] = []
    event.listen(sessions.kw["bind"], "before_cursor_execute",
                 lambda _c, _cur, statement, *_: writes.append(statement) if "UPDATE" in statement else None)
    def written() -> ApiKey:
        with sessions() as session:
            row = session.get(ApiKey, key_id)
            assert row is not None
            return row

    first = wall.now
    auth.note_use(key_id, "127.0.0.2")  # the first use starts a flush at once (a timer thread)
    deadline = time.monotonic() + 10
    while written().last_used_address is None and time.monotonic() < deadline:
        time.sleep(0.01)
    for offset in (1.0, 2.0):
        wall.now = first + offset
        auth.note_use(key_id, "127.0.0.3")  # noted in memory; the next flush is an interval away
    time.sleep(0.1)
    row = written()
    assert len(writes) == 1 and row.last_used_address == "127.0.0.2"
    assert row.last_used_at is not None and abs(row.last_used_at.timestamp() - first) < 0.01
    assert auth.flush_last_used() == 1  # what the timer would write an interval later
    wall.now = first - 100  # another process' older use never moves the time back
    auth.note_use(key_id, "127.0.0.9")
    auth.flush_last_used()
    with sessions() as session:
        [info] = [k for k in list_keys(session) if k.key_id == key_id]
    assert info.last_used_address == "127.0.0.3"
    assert info.last_used_at is not None and abs(info.last_used_at.timestamp() - (first + 2)) < 0.01
    auth.close()  # the timer scheduled an interval ahead goes; nothing is left to write
    assert auth.flush_last_used() == 0


def test_a_failed_last_use_flush_is_only_logged(sessions: sessionmaker[Session]) -> None:
    def broken() -> Session:
        raise RuntimeError("database down")

    auth = KeyAuthenticator(broken, last_used_flush_seconds=3600)
    auth._used["0123456789ab"] = (time.time(), None)  # as note_use leaves it, without the timer
    assert auth.flush_last_used() == 0


def test_overlap_durations() -> None:
    assert [parse_duration(text) for text in ("0", "45", "30s", "15m", "24h", "7d", "1.5h")] == \
        [0, 45, 30, 900, 86400, 604800, 5400]
    for bad in ("", "h", "24x", "-1h", "1h30m"):
        with pytest.raises(ValueError, match="duration"):
            parse_duration(bad)


def test_the_admin_api_grants_every_scope_the_keys_know() -> None:
    """POST /v1/admin/keys refused ``webhooks``, which the CLI and docs/security.md grant."""
    from typing import get_args

    from api.schemas.admin import KeyCreate, Scope
    from scheduler.access.api_keys import ALL_SCOPES

    assert set(get_args(Scope)) == ALL_SCOPES
    assert KeyCreate(tenant="t", scopes=sorted(ALL_SCOPES)).scopes == sorted(ALL_SCOPES)
