"""Hostile client input (issue 16) refused with 4xx JSON errors, pure logic and a minimal app.

Where a real database shows that nothing was stored, see
``tests/integration/test_api_hostile_input.py``; here: the JSON parser's limits, the text,
timestamp, metadata and sampling-parameter rules of the request models, the list cursor, and an
error renderer that survives any value a client can make it echo.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from datetime import datetime
from typing import Annotated

import pytest
from fastapi import Body, FastAPI, Query
from fastapi.testclient import TestClient
from pydantic import TypeAdapter, ValidationError

from api.errors import ApiError, install_error_handlers, json_safe
from api.json_input import MAX_DEPTH, MAX_NUMBER_CHARS, JsonInputError, LimitedJsonRoute, loads
from api.limits import check_job_limits, metadata_bytes
from api.prompt_tokens import PromptTokenCounter
from api.schemas.common import UtcDateTime
from api.schemas.jobs import JobCreate
from scheduler.infra.settings import Settings
from scheduler.jobs.models import as_utc
from scheduler.jobs.service import InvalidCursorError, decode_cursor

CREATE: TypeAdapter = TypeAdapter(JobCreate)
SURROGATES = ["\ud800", "ok \udfff end", "\udc00\ud800"]  # lone high, lone low, reversed pair


def _nested(levels: int) -> str:
    return "[" * levels + "]" * levels


# --- the JSON parser --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (_nested(10_000), "nested"),  # json.loads: RecursionError
        (_nested(MAX_DEPTH + 1), "nested"),  # below the recursion limit, above ours
        ('{"a":' * 5_000 + "1" + "}" * 5_000, "nested"),
        ("1" * 5_000, "characters"),  # json.loads: ValueError (int digits limit)
        ('{"seed": ' + "9" * (MAX_NUMBER_CHARS + 1) + "}", "characters"),
        ("0." + "1" * 5_000, "characters"),
        ('{"threshold": NaN}', "NaN"),
        ("[Infinity]", "Infinity"),
        ("[-Infinity]", "Infinity"),
        ("[1e999]", "out of range"),
        ("{not json", "property name"),
        (b"\xff\xfe\x00", ""),  # not UTF-8 (nor any JSON encoding)
    ],
)
def test_loads_refuses_hostile_json_as_a_decode_error(text: str | bytes, reason: str) -> None:
    with pytest.raises(JsonInputError) as caught:
        loads(text)
    assert isinstance(caught.value, json.JSONDecodeError)  # callers handle it as malformed JSON
    assert reason in caught.value.msg


def test_loads_accepts_ordinary_json_up_to_the_limits() -> None:
    assert loads(_nested(MAX_DEPTH)) is not None
    assert loads('{"seed": ' + "9" * MAX_NUMBER_CHARS + "}")["seed"] == int("9" * MAX_NUMBER_CHARS)
    body = {"kind": "generate", "input": {"messages": [{"role": "user", "content": "hi \U0001f600"}]},
            "params": {"temperature": 0.7, "seed": 2**63 - 1}, "metadata": {"n": -3, "x": 1.5e300}}
    assert loads(json.dumps(body)) == body  # json.dumps escapes the emoji as a surrogate PAIR
    assert loads(json.dumps(body).encode()) == body


def _json_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.router.route_class = LimitedJsonRoute

    @app.post("/echo")
    def echo(body: dict = Body()) -> dict:  # type: ignore[type-arg]
        return body

    @app.get("/since")
    def since(at: Annotated[UtcDateTime, Query()]) -> dict[str, str]:
        return {"at": at.isoformat()}

    @app.get("/nan")
    def nan() -> None:
        raise ApiError(422, "invalid_request", "bad threshold",
                       [{"loc": ["threshold"], "value": float("nan")}, {"value": float("-inf")}])

    @app.get("/echoes")
    def echoes() -> None:
        raise ApiError(422, "invalid_request", "echoed input",
                       {"surrogate": "\ud800", "k\udc00": (1, 2), "huge": 10**5000, "deep": _deep(500),
                        "object": object()})

    return app


def _deep(levels: int) -> list:  # type: ignore[type-arg]
    value: list = []  # type: ignore[type-arg]
    for _ in range(levels):
        value = [value]
    return value


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(_json_app(), raise_server_exceptions=False) as test_client:
        yield test_client


def _error(response) -> dict:  # type: ignore[no-untyped-def]
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}
    return body["error"]


@pytest.mark.parametrize(
    "raw", [_nested(10_000), '{"a": ' + "7" * 5_000 + "}", '{"t": NaN}', '{"t": 1e999}'],
)
def test_route_bodies_are_parsed_with_the_limits(client: TestClient, raw: str) -> None:
    response = client.post("/echo", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 422
    error = _error(response)
    assert error["code"] == "invalid_request"
    assert error["details"][0]["type"] == "json_invalid"
    assert "JSON decode error:" in error["details"][0]["message"]  # says why
    assert client.post("/echo", json={"a": [1, {"b": None}]}).json() == {"a": [1, {"b": None}]}


def test_error_details_with_nan_are_rendered_not_a_500(client: TestClient) -> None:
    response = client.get("/nan")
    assert response.status_code == 422
    assert _error(response)["details"] == [{"loc": ["threshold"], "value": "nan"}, {"value": "-inf"}]


def test_error_details_with_unencodable_values_are_rendered_not_a_500(client: TestClient) -> None:
    response = client.get("/echoes")
    assert response.status_code == 422
    details = _error(response)["details"]
    assert details["surrogate"] == "\\ud800"  # kept visible as an escape
    assert details["k\\udc00"] == [1, 2]
    assert details["huge"].startswith("<integer of")
    assert details["object"].startswith("<object object")
    depth, node = 0, details["deep"]
    while isinstance(node, list):
        depth, node = depth + 1, node[0]
    assert node == "..." and depth < 20


def test_json_safe_keeps_ordinary_details_unchanged() -> None:
    details = [{"loc": ["body", "params", "top_k"], "message": "at most 5", "value": 7, "ok": True,
                "ratio": 0.5, "none": None, "text": "é ✓"}]
    assert json_safe(details) == details


# --- timestamps and cursors -------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", ["2024-01-01T00:00:00", "2024-01-01", "0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00"],
)
def test_naive_or_out_of_range_timestamps_are_422(client: TestClient, value: str) -> None:
    response = client.get("/since", params={"at": value})
    assert response.status_code == 422
    error = _error(response)
    assert error["code"] == "invalid_request" and error["details"][0]["loc"] == ["query", "at"]


def test_timestamps_with_an_offset_are_normalized_to_utc(client: TestClient) -> None:
    response = client.get("/since", params={"at": "2024-01-01T02:00:00+02:00"})
    assert response.json() == {"at": "2024-01-01T00:00:00+00:00"}
    assert as_utc(datetime.fromisoformat("0001-01-01T00:00:00+00:00")).year == 1


def _cursor(raw: str) -> str:
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    "created", ["2024-01-01T00:00:00", "0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00", "x"],
)
def test_crafted_cursors_are_invalid_cursors(created: str) -> None:
    with pytest.raises(InvalidCursorError):
        decode_cursor(_cursor(f"{created}|00000000-0000-0000-0000-000000000000"))
    ok, _ = decode_cursor(_cursor("2024-01-01T00:00:00+00:00|00000000-0000-0000-0000-000000000000"))
    assert ok.utcoffset() is not None


# --- text fields ------------------------------------------------------------------------------


def _generate(**overrides: object) -> dict:
    return {"kind": "generate", "input": {"prompt": "hello"}, **overrides}


def _decide(context: str = "doc", question: str = "ok?", qid: str = "a", choices: list[str] | None = None,
            **overrides: object) -> dict:
    q: dict = {"id": qid, "text": question}
    if choices is not None:
        q["choices"] = choices
    return {"kind": "decide", "input": {"context": context, "questions": [q]}, **overrides}


def _extract(context: str = "doc", **input_fields: object) -> dict:
    return {"kind": "extract", "input": {"context": context, "schema": {"type": "object"}, **input_fields}}


def _text_bodies(text: str) -> list[dict]:
    return [
        _generate(input={"prompt": text}),
        _generate(input={"messages": [{"role": "user", "content": text}]}),
        _generate(metadata={"k": text}),
        _generate(metadata={text: "v"}),
        _generate(params={"fault": text}),
        _decide(context=text),
        _decide(question=text),
        _decide(qid=text),
        _decide(choices=[text, "no"]),
        _decide(metadata={"k": text}),
        _extract(context=text),
        _extract(instructions=text),
    ]


@pytest.mark.parametrize("body", [b for s in SURROGATES for b in _text_bodies(s)])
def test_lone_surrogates_are_refused_in_every_text_field(body: dict) -> None:
    with pytest.raises(ValidationError):
        CREATE.validate_python(body)


@pytest.mark.parametrize("body", _text_bodies("nul \x00 inside"))
def test_nul_is_refused_in_every_text_field(body: dict) -> None:
    with pytest.raises(ValidationError):
        CREATE.validate_python(body)


@pytest.mark.parametrize("body", _text_bodies("ordinary text, é, \U0001f600"))
def test_ordinary_unicode_is_accepted_in_every_text_field(body: dict) -> None:
    if body["kind"] == "decide" and "choices" in body["input"]["questions"][0]:
        body["input"]["questions"][0]["choices"] = ["ordinary é \U0001f600", "no"]
    CREATE.validate_python(body)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_metadata_values_are_refused(value: float) -> None:
    with pytest.raises(ValidationError):
        CREATE.validate_python(_generate(metadata={"k": value}))


@pytest.mark.parametrize("value", [{"b": 1}, [1, 2], []])
def test_a_nested_metadata_value_is_one_error_saying_metadata_is_flat(value: object) -> None:
    """One error at the key, not one per member of the value union under pydantic's inner names."""
    with pytest.raises(ValidationError) as refused:
        CREATE.validate_python(_generate(metadata={"a": value}))
    errors = refused.value.errors()
    assert len(errors) == 1 and errors[0]["loc"][-1] == "a"
    assert "metadata is flat" in errors[0]["msg"] and "function-after" not in str(errors[0]["loc"])


# --- sampling parameter bounds ----------------------------------------------------------------

GENERATE_OUT_OF_BOUNDS = [
    ("top_k", 10**30), ("top_k", 2**63), ("top_k", (1 << 20) + 1), ("seed", 2**63), ("seed", -1),
    ("max_new_tokens", 10**30), ("max_new_tokens", (1 << 20) + 1), ("step_budget", 10**30),
    ("step_budget", (1 << 24) + 1), ("block_size", 1025), ("steps_per_block", 10**30),
    ("steps_per_block", 1025), ("temperature", 10.5), ("temperature", 1e308), ("top_p", 1.5),
    ("threshold", 2.0), ("threshold", float("nan")), ("temperature", float("inf")),
]


@pytest.mark.parametrize(("field", "value"), GENERATE_OUT_OF_BOUNDS)
def test_generate_params_beyond_their_bounds_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as caught:
        CREATE.validate_python(_generate(params={field: value}))
    assert caught.value.errors()[0]["loc"][-1] == field


@pytest.mark.parametrize(
    ("field", "value"),
    [(f, v) for f, v in GENERATE_OUT_OF_BOUNDS if f != "max_new_tokens"] + [("seed", 2**62 + 1)],
)
def test_decide_params_beyond_their_bounds_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as caught:
        CREATE.validate_python(_decide(params={field: value}))
    assert caught.value.errors()[0]["loc"][-1] == field


@pytest.mark.parametrize(("field", "value"),
                         [(f, v) for f, v in GENERATE_OUT_OF_BOUNDS if f != "max_new_tokens"])
def test_extract_params_beyond_their_bounds_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as caught:
        CREATE.validate_python({**_extract(), "params": {field: value}})
    assert caught.value.errors()[0]["loc"][-1] == field


def test_params_at_their_bounds_are_accepted() -> None:
    CREATE.validate_python(_generate(params={"top_k": 1 << 20, "seed": 2**63 - 1, "temperature": 10.0,
                                             "block_size": 1024, "steps_per_block": 1024,
                                             "step_budget": 1 << 24, "max_new_tokens": 1 << 20}))
    CREATE.validate_python(_decide(params={"top_k": 1 << 20, "seed": 2**62, "step_budget": 1 << 24}))


# --- metadata size ----------------------------------------------------------------------------


def _limits(body: dict, **settings: object) -> dict:
    return check_job_limits(CREATE.validate_python(body), settings=Settings(**settings),  # type: ignore[arg-type]
                            counter=PromptTokenCounter(None), faults_enabled=False)


@pytest.mark.parametrize("kind", ["generate", "decide"])
def test_metadata_over_the_size_cap_is_refused(kind: str) -> None:
    metadata = {f"k{i}": "x" * 31_000 for i in range(32)}  # ~1 MB: what the fault run stored per job
    body = (_generate if kind == "generate" else _decide)(metadata=metadata)
    with pytest.raises(ApiError) as caught:
        _limits(body)
    assert caught.value.status_code == 422 and caught.value.code == "metadata_too_large"
    assert caught.value.details[0]["loc"] == ["body", "metadata"]
    assert caught.value.details[0]["value"] == metadata_bytes(metadata)


def test_metadata_exactly_at_the_cap_is_accepted_and_one_byte_more_is_not() -> None:
    cap = Settings().limits.max_metadata_bytes
    assert cap == 16_384
    overhead = metadata_bytes({"k": ""})
    _limits(_generate(metadata={"k": "x" * (cap - overhead)}))
    with pytest.raises(ApiError):
        _limits(_generate(metadata={"k": "x" * (cap - overhead + 1)}))
    with pytest.raises(ApiError):  # multi-byte characters count as the bytes they are stored as
        _limits(_generate(metadata={"k": "é" * (cap // 2)}))
    _limits(_generate(metadata={"k": "x" * 2000}), max_metadata_bytes=4096)
    with pytest.raises(ApiError):
        _limits(_generate(metadata={"k": "x" * 5000}), max_metadata_bytes=4096)


def test_credentials_in_a_webhook_url_are_refused_at_submit() -> None:
    for url in ("https://user:secret@hooks.example.com/x", "https://token@hooks.example.com/x"):
        with pytest.raises(ApiError) as caught:
            _limits(_generate(webhook_url=url))
        assert caught.value.code == "invalid_webhook_url"
        assert "secret" not in caught.value.message
    _limits(_generate(webhook_url="https://hooks.example.com/x"))
