"""response_schema at the API (pure logic): OpenAI's response_format translated to the generate
job's input, and a schema outside the subset refused at submit with its stable code."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import TypeAdapter

from api import openai_compat as oa
from api.errors import ApiError
from api.limits import check_generate_limits
from api.prompt_tokens import PromptTokenCounter
from api.schemas.jobs import GenerateJobCreate, JobCreate
from scheduler.infra.settings import Settings
from tests.unit.schema_cases import OUTSIDE_THE_SUBSET

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
          "required": ["name"]}


def _chat(response_format: Any) -> GenerateJobCreate:
    req = oa.parse_request(oa.ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": response_format,
    })
    return oa.chat_job(req)


def _submit(schema: Any, **settings: Any) -> dict[str, Any]:
    body = TypeAdapter(JobCreate).validate_python(
        {"kind": "generate", "input": {"prompt": "hi", "response_schema": schema}})
    assert isinstance(body, GenerateJobCreate)
    return check_generate_limits(body, settings=Settings(**settings), counter=PromptTokenCounter(None),
                                 faults_enabled=False)


def test_response_format_becomes_the_jobs_response_schema() -> None:
    job = _chat({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert job.input.response_schema == PERSON
    assert job.input.model_dump(exclude_none=True)["response_schema"] == PERSON  # stored as given
    assert _chat({"type": "json_object"}).input.response_schema == {"type": "object"}
    assert _chat({"type": "text"}).input.response_schema is None
    assert _chat(None).input.response_schema is None


@pytest.mark.parametrize(
    ("response_format", "code", "param"),
    [
        ({"type": "json_schema"}, "invalid_request", "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": PERSON}}, "invalid_request",
         "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": PERSON, "extra": 1}},
         "unrecognized_argument", "response_format.json_schema.extra"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}, "invalid_schema",
         "response_format.json_schema.schema"),
        ({"type": "json_object", "schema": PERSON}, "unrecognized_argument", "response_format.schema"),
    ],
)
def test_a_malformed_response_format_is_a_400_naming_the_parameter(
    response_format: dict[str, Any], code: str, param: str
) -> None:
    with pytest.raises(ApiError) as caught:
        _chat(response_format)
    assert (caught.value.status_code, caught.value.code, caught.value.param) == (400, code, param)


def test_the_legacy_functions_stay_refused_with_a_message_that_says_why() -> None:
    req = oa.parse_request(oa.ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "functions": [{"name": "f"}]})
    with pytest.raises(ApiError) as caught:
        oa.chat_job(req)
    assert (caught.value.status_code, caught.value.code, caught.value.param) == (400, "unsupported_parameter",
                                                                                  "functions")
    assert "'tools'" in str(caught.value)


def test_a_schema_inside_the_subset_is_accepted() -> None:
    assert _submit(PERSON)["max_new_tokens"] > 0


@pytest.mark.parametrize(
    ("schema", "code", "keyword", "path"),
    OUTSIDE_THE_SUBSET,
)
def test_a_schema_outside_the_subset_is_a_400_with_its_code(
    schema: dict[str, Any], code: str, keyword: str | None, path: str
) -> None:
    with pytest.raises(ApiError) as caught:
        _submit(schema)
    error = caught.value
    assert (error.status_code, error.code) == (400, code)
    (detail,) = error.details
    assert detail["loc"] == ["body", "input", "response_schema"]
    assert (detail["keyword"], detail["path"]) == (keyword, path)


def test_the_schema_limits_come_from_settings() -> None:
    nested: dict[str, Any] = {"type": "string"}
    for _ in range(4):
        nested = {"type": "array", "items": nested}
    assert _submit(nested)  # depth 4 within the default 6
    with pytest.raises(ApiError) as deep:
        _submit(nested, max_schema_depth=3)
    assert (deep.value.status_code, deep.value.code) == (400, "schema_too_large")
    wide = {"type": "object", "properties": {f"field_{i}": {"type": "boolean"} for i in range(20)}}
    with pytest.raises(ApiError) as large:
        _submit(wide, max_schema_bytes=128)
    assert (large.value.status_code, large.value.code) == (400, "schema_too_large")
    assert "128" in str(large.value)
