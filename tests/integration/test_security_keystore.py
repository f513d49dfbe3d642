"""The key store on each real backend (SQLite and PostgreSQL), migrated by Alembic."""

from __future__ import annotations

import pytest

from scheduler.access.api_keys import KeyAuthenticator, create_key, list_keys, revoke_key
from scheduler.infra.db import make_engine, session_factory

pytestmark = pytest.mark.integration


def test_keys_on_the_migrated_schema(db_backend_url: str) -> None:
    sessions = session_factory(make_engine(db_backend_url))
    auth = KeyAuthenticator(sessions, cache_seconds=0)
    with sessions() as session:
        created = create_key(session, tenant="store-test", scopes=["read", "admin"], label="backend")
    info = auth.authenticate(created.key)
    assert info is not None and info.scopes == {"read", "admin"} and info.created_at.tzinfo is not None
    with sessions() as session:
        [listed] = [k for k in list_keys(session, tenant="store-test") if k.key_id == created.info.key_id]
        assert listed.label == "backend" and not listed.revoked
        revoked = revoke_key(session, key_id=created.info.key_id)
        assert revoked is not None and revoked.revoked_at is not None
        assert revoke_key(session, key_id=created.info.key_id).revoked_at == revoked.revoked_at  # idempotent
    assert auth.authenticate(created.key) is None
