"""``response_format`` through the official ``openai`` client, unchanged, against a running stack
(API over HTTP, a real worker on the tiny Clover demo): the content validates against the schema
(judged by ``jsonschema``), a streamed call's deltas add up to the final content, and a schema
outside the subset is a 400 with its code and no job stored."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.integration import test_openai_compat as compat
from tests.integration.test_openai_compat import Stack

pytestmark = pytest.mark.integration

stack = compat.stack  # the same module-scoped stack (API + worker on the Clover demo)
QUICK = {"block_size": 4, "steps_per_block": 2}

CONTRACT = {
    "type": "object",
    "properties": {
        "party": {"type": "string", "minLength": 1, "maxLength": 10},
        "notice_days": {"type": "integer", "minimum": 1, "maximum": 365},
        "law": {"enum": ["NY", "DE", "CA"]},
        "renews": {"type": "boolean"},
    },
    "required": ["party", "notice_days", "law", "renews"],
    "additionalProperties": False,
}
# optional keys and items sit behind gates: a closed gate's value slots are decoded but not read
OPTIONAL = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                   "note": {"type": "string", "maxLength": 8},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["id"],
}
TAGS = {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3}


def _ask(stack: Stack, schema: dict[str, Any], **kwargs: Any) -> Any:
    return stack.openai().chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Extract the contract's fields."}],
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        temperature=0.7, seed=5, extra_body=QUICK, **kwargs,
    )


@pytest.mark.parametrize("schema", [CONTRACT, TAGS], ids=["object", "array"])
def test_json_schema_content_validates(stack: Stack, schema: dict[str, Any]) -> None:
    reply = _ask(stack, schema)
    content = reply.choices[0].message.content
    assert isinstance(content, str)
    jsonschema.validate(json.loads(content), schema)
    job = stack.job(reply.id.removeprefix("chatcmpl-"))  # the cloverq job behind it
    assert job["status"] == "succeeded" and job["result"]["text"] == content


class Party(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    role: Literal["provider", "customer"]


class Fields(pydantic.BaseModel):
    parties: list[Party] = pydantic.Field(max_length=2)
    notice_days: int
    renews: bool
    law: str | None


def test_the_sdks_parse_helper_reads_the_value(stack: Stack) -> None:
    """``chat.completions.parse`` with a pydantic model, as pipelines call it: the SDK refuses a
    reply whose ``finish_reason`` is ``length`` (``LengthFinishReasonError``), so a complete
    canvas must finish with ``stop``; a nested model reaches the server as a ``$ref`` into
    ``$defs``; the parsed value is the job's ``data``."""
    reply = stack.openai().chat.completions.parse(
        model=stack.model, messages=[{"role": "user", "content": "Extract the contract's fields."}],
        response_format=Fields, seed=3, extra_body=QUICK,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Fields)
    job = stack.job(reply.id.removeprefix("chatcmpl-"))
    assert job["result"]["finish_reason"] == "eos"
    assert choice.message.parsed.model_dump() == job["result"]["data"]


def test_json_object_is_a_json_object(stack: Stack) -> None:
    reply = stack.openai().chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Any JSON object."}],
        response_format={"type": "json_object"}, seed=2, extra_body=QUICK,
    )
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


@pytest.mark.parametrize("schema", [CONTRACT, OPTIONAL], ids=["required", "optional"])
def test_a_streamed_structured_call_adds_up_to_the_final_json(stack: Stack, schema: dict[str, Any]) -> None:
    chunks = list(_ask(stack, schema, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"  # a complete value, never "cut off"
    jsonschema.validate(json.loads(content), schema)
    job = stack.job(chunks[0].id.removeprefix("chatcmpl-"))
    assert job["result"]["text"] == content


@pytest.mark.parametrize(
    ("schema", "code"),
    [({"type": "string", "pattern": "^a"}, "unsupported_schema_keyword"),
     ({"type": "string", "minLength": 3, "maxLength": 1}, "invalid_schema")],
)
def test_a_schema_outside_the_subset_is_a_400_and_nothing_is_stored(
    stack: Stack, schema: dict[str, Any], code: str
) -> None:
    label = f"refused-{code}-{time.monotonic_ns()}"
    with pytest.raises(openai.BadRequestError) as caught:
        _ask(stack, schema, metadata={"probe": label})
    assert caught.value.code == code
    assert caught.value.param == "response_format.json_schema.schema"
    assert stack.jobs_with(label) == []


def test_the_job_api_answers_the_same_400_with_keyword_and_path(stack: Stack) -> None:
    label = f"refused-job-{time.monotonic_ns()}"
    response = httpx.post(
        f"{stack.url}/v1/jobs", headers={"Authorization": f"Bearer {stack.key}"},
        json={"kind": "generate", "metadata": {"probe": label},
              "input": {"prompt": "x", "response_schema": {"type": "object", "properties": {
                  "code": {"type": "string", "pattern": "^[A-Z]+$"}}}}},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "unsupported_schema_keyword"
    assert error["details"][0]["keyword"] == "pattern"
    assert error["details"][0]["path"] == "#/properties/code/pattern"
    assert stack.jobs_with(label) == []
