"""The ``extract`` request at submit (pure logic): the request model, its limits and 400 codes
(the same checker and codes as ``response_schema``, ``loc`` at ``input.schema``), the params
stored, the cost the router gives it, and the prompt both sides build (the document first)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from api.errors import ApiError
from api.limits import check_job_limits
from api.prompt_tokens import PromptTokenCounter
from api.schemas.jobs import ExtractJobCreate, JobCreate
from scheduler.infra.settings import Settings
from scheduler.jobs.extract_prompt import extract_messages, render_fields
from scheduler.jobs.models import QueueName
from scheduler.jobs.routing import estimate_cost, route_job
from tests.unit.schema_cases import OUTSIDE_THE_SUBSET

ADAPTER: TypeAdapter[Any] = TypeAdapter(JobCreate)
COUNTER = PromptTokenCounter(None)  # byte bound
CONTRACT = {
    "type": "object",
    "properties": {
        "party": {"type": "string", "maxLength": 20, "description": "the seller"},
        "notice_days": {"type": "integer", "minimum": 1, "maximum": 365},
        "law": {"enum": ["NY", "DE", "CA"]},
        "signed": {"type": "string", "format": "date"},
    },
    "required": ["party", "law"],
}


def _body(**input_overrides: Any) -> dict[str, Any]:
    job_input: dict[str, Any] = {"context": "Acme Corp sells widgets to Bolt Ltd.", "schema": CONTRACT}
    job_input.update(input_overrides)
    return {"kind": "extract", "input": {k: v for k, v in job_input.items() if v is not None}}


def _check(body: dict[str, Any], **settings: Any) -> dict[str, Any]:
    return check_job_limits(ADAPTER.validate_python(body), settings=Settings(**settings), counter=COUNTER,
                            faults_enabled=False)


def test_extract_is_a_member_of_the_job_union_and_stores_its_input_as_sent() -> None:
    job = ADAPTER.validate_python({**_body(instructions="Find the seller."), "params": {"seed": 3}})
    assert isinstance(job, ExtractJobCreate)
    assert job.input.model_dump(exclude_none=True) == {  # what the route stores: "schema", not "schema_"
        "context": "Acme Corp sells widgets to Bolt Ltd.", "schema": CONTRACT,
        "instructions": "Find the seller."}
    assert _check(_body()) == {"temperature": 0.0}  # no max_new_tokens, no thinking: the canvas decides


@pytest.mark.parametrize(
    ("input_overrides", "field"),
    [({"context": None}, "context"), ({"context": ""}, "context"), ({"context": " \n"}, "context"),
     ({"schema": None}, "schema"), ({"schema": "object"}, "schema"), ({"instructions": 3}, "instructions"),
     ({"questions": []}, "questions")],
)
def test_a_malformed_input_is_a_validation_error_naming_the_field(
    input_overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValidationError) as caught:  # the API answers 422 invalid_request, nothing stored
        ADAPTER.validate_python(_body(**input_overrides))
    assert any(error["loc"][:3] == ("extract", "input", field) for error in caught.value.errors())


@pytest.mark.parametrize("params", [{"thinking": True}, {"max_new_tokens": 8}, {"temperature": -1}])
def test_params_outside_the_kind_are_refused(params: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ADAPTER.validate_python({**_body(), "params": params})


@pytest.mark.parametrize(
    ("schema", "code", "keyword", "path"),
    OUTSIDE_THE_SUBSET,
)
def test_a_schema_outside_the_subset_is_a_400_at_input_schema(
    schema: dict[str, Any], code: str, keyword: str | None, path: str
) -> None:
    with pytest.raises(ApiError) as caught:
        _check(_body(schema=schema))
    error = caught.value
    assert (error.status_code, error.code) == (400, code)
    assert error.message.startswith("input.schema: ")
    (detail,) = error.details
    assert detail["loc"] == ["body", "input", "schema"]
    assert (detail["keyword"], detail["path"]) == (keyword, path)


def test_the_schema_and_prompt_limits_come_from_settings() -> None:
    with pytest.raises(ApiError) as large:
        _check(_body(), max_schema_bytes=64)
    assert (large.value.status_code, large.value.code) == (400, "schema_too_large")
    assert large.value.details[0]["setting"] == "CLOVERQ_MAX_SCHEMA_BYTES"
    with pytest.raises(ApiError) as long:
        _check(_body(context="word " * 400), max_prompt_tokens=1000)
    assert (long.value.status_code, long.value.code) == (422, "prompt_too_long")
    assert "split the document" in long.value.message
    with pytest.raises(ApiError) as steps:
        _check({**_body(), "params": {"block_size": 4, "steps_per_block": 8}})
    assert steps.value.status_code == 422


def test_the_cost_is_the_schemas_canvas_not_max_new_tokens() -> None:
    settings = Settings(default_max_new_tokens=4096, default_steps_per_block=4, interactive_max_cost=1000)
    small = {"schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}}}
    cost = estimate_cost(kind="extract", input=small, params={}, settings=settings)
    assert 0 < cost <= 64 * 4  # '{"ok": ' + a choice of 'true'/'false' + '}', 4 passes each
    assert estimate_cost(kind="extract", input={"schema": CONTRACT}, params={}, settings=settings) > cost
    stale = {"schema": {"type": "string", "pattern": "^a"}}  # refused at submit; limits may change later
    assert estimate_cost(kind="extract", input=stale, params={}, settings=settings) == 4096 * 4
    route = route_job(kind="extract", input=small, params={}, priority=None, settings=settings)
    assert route.queue is QueueName.INTERACTIVE
    bigger = {"schema": {"type": "array", "items": CONTRACT, "minItems": 3, "maxItems": 3}}
    assert route_job(kind="extract", input=bigger, params={}, priority=None, settings=settings).queue \
        is not QueueName.INTERACTIVE


def test_the_prompt_puts_the_document_first_so_jobs_over_it_share_a_prefix() -> None:
    doc = "MASTER SERVICES AGREEMENT between Acme Corp and Bolt Ltd. " * 3
    one = extract_messages(doc, CONTRACT)
    two = extract_messages(doc, {"type": "object", "properties": {"total": {"type": "number"}}}, "Amounts.")
    assert one[0] == two[0]  # the fixed system turn
    assert one[1]["content"].startswith(f"Document:\n{doc}\n\n")
    assert two[1]["content"].startswith(f"Document:\n{doc}\n\nAmounts.\n\n")


def test_the_fields_are_rendered_short() -> None:
    lines = render_fields(CONTRACT).splitlines()
    assert lines == [
        "- party: text, at most 20 characters — the seller",
        "- notice_days (optional): integer, >= 1 and <= 365",
        '- law: one of "NY", "DE", "CA"',
        "- signed (optional): date (YYYY-MM-DD)",
    ]
    assert render_fields({"type": "array", "items": {"type": "boolean"}, "maxItems": 2}) == \
        "- list of true or false, at most 2 items"


def test_referenced_fields_are_rendered_as_what_they_refer_to() -> None:
    """A pydantic model's nested model and enum come as $refs into $defs: rendered as the object
    and the choice they are (the canvas lays them out so), the field's own description kept."""
    schema = {"$defs": {"Law": {"enum": ["NY", "DE"], "type": "string"},
                        "Party": {"type": "object", "properties": {"name": {"type": "string"}},
                                  "required": ["name"]}},
              "type": "object", "required": ["seller", "law"],
              "properties": {"seller": {"$ref": "#/$defs/Party", "description": "who sells"},
                             "law": {"$ref": "#/$defs/Law"}}}
    assert render_fields(schema).splitlines() == [
        "- seller: object — who sells",
        "  - name: text",
        '- law: one of "NY", "DE"',
    ]
