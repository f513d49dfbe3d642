"""A job's documents come back with the key order they were sent in, on both SQL backends.

PostgreSQL's ``jsonb`` sorted object keys (shorter first), so an extract schema's properties, the
order its canvas lays fields out and its prompt lists them, came back reordered there and not on
SQLite: one request, two decodings (migration ``0016_json_keeps_key_order``). ``jsonb`` puts shorter
keys first: it would change the order of the schema's properties, of the params, of the metadata
and of the result's value below."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import inspect

from scheduler.infra.db import get_session_factory, make_engine
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job
from scheduler.jobs.service import submit_job

pytestmark = pytest.mark.integration

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"termination_notice_days": {"type": "integer"}, "law": {"type": "string"},
                   "capped": {"enum": ["yes", "no", None]}},
    "required": ["termination_notice_days", "law", "capped"],
}


def _keys(value: Any) -> Any:
    """Every object's keys, in order, recursively (lists kept)."""
    if isinstance(value, dict):
        return [(key, _keys(item)) for key, item in value.items()]
    if isinstance(value, list):
        return [_keys(item) for item in value]
    return None


def test_input_params_metadata_and_result_keep_their_key_order(db_backend_url: str,
                                                               make_settings: Any) -> None:
    settings: Settings = make_settings(database_url=db_backend_url)
    sessions = get_session_factory(db_backend_url)
    document = {"text": "The agreement ends on notice.", "schema": SCHEMA}
    params = {"max_new_tokens": 64, "block_size": 4}
    metadata = {"source_document": "c-17", "row": 3}
    result = {"value": {"termination_notice_days": 30, "law": "Italy", "capped": None}, "tokens": 12}
    with sessions() as session:
        job, _ = submit_job(session, tenant="t-" + uuid.uuid4().hex[:8], kind="extract", input=document,
                            params=params, metadata=metadata, settings=settings, publish=False)
        job.result = result
        session.commit()
        job_id = job.id
    with sessions() as session:  # a new session: the values as the database returns them
        stored = session.get(Job, job_id)
        assert stored is not None
        assert _keys(stored.input) == _keys(document)
        assert list(stored.input["schema"]["properties"]) == ["termination_notice_days", "law", "capped"]
        assert _keys(stored.params) == _keys(params)
        assert _keys(stored.meta) == _keys(metadata)
        assert _keys(stored.result) == _keys(result)


def test_no_json_column_is_jsonb(db_backend_url: str) -> None:
    engine = make_engine(db_backend_url)
    inspector = inspect(engine)
    types = {(table, column["name"]): str(column["type"]).lower()
             for table in inspector.get_table_names() for column in inspector.get_columns(table)}
    assert not [name for name, kind in types.items() if "jsonb" in kind]
    assert types[("jobs", "input")] == "json"
