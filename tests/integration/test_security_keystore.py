"""The key store on each real backend (SQLite and PostgreSQL), migrated by Alembic."""

from __future__ import annotations

import pytest

from scheduler.access.api_keys import create_key, list_keys, revoke_key
from scheduler.access.key_authenticator import KeyAuthenticator
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


def test_0012_adds_the_key_columns_and_goes_down_and_up_again(fresh_db_url: str) -> None:
    """0012_api_key_rotation: the head's ``api_keys`` is the model's; down to 0011 drops the new
    columns (the keys stay usable), up again restores them."""
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy import inspect

    from scheduler.infra.db import alembic_config, migrate
    from scheduler.jobs.models import Base

    engine = make_engine(fresh_db_url)
    sessions = session_factory(engine)
    new_columns = {"expires_at", "rotated_from", "allowed_networks", "last_used_at", "last_used_address"}
    try:
        with engine.connect() as conn:
            diffs = [d for d in compare_metadata(MigrationContext.configure(conn), Base.metadata)
                     if "api_keys" in repr(d)]
        assert diffs == []
        with sessions() as session:
            created = create_key(session, tenant="migrated", scopes=["read"], allowed_networks=["10.0.0.0/8"])
        command.downgrade(alembic_config(fresh_db_url), "0011_job_trace")
        assert not new_columns & {c["name"] for c in inspect(engine).get_columns("api_keys")}
        migrate(fresh_db_url)
        assert new_columns <= {c["name"] for c in inspect(engine).get_columns("api_keys")}
        info = KeyAuthenticator(sessions, cache_seconds=0).authenticate(created.key)
        assert info is not None and info.allowed_networks == ()  # the column came back empty
    finally:
        engine.dispose()
