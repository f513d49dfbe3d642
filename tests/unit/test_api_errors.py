"""The API's error shape and the body-size limit, on a minimal app (no database, no Redis)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict
from sqlalchemy.exc import OperationalError

from api.body_limit import BodyLimitMiddleware
from api.errors import ApiError, install_error_handlers

LIMIT = 2048


class Echo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=LIMIT)

    @app.post("/echo")
    def echo(body: Echo) -> Echo:
        return body

    @app.get("/teapot")
    def teapot() -> None:
        raise ApiError(418, "teapot", "I am a teapot.", {"why": "tests"}, {"X-Extra": "1"})

    @app.get("/db-down")
    def db_down() -> None:
        raise OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))

    @app.get("/bug")
    def bug() -> None:
        raise RuntimeError("boom")

    return app


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(_app(), raise_server_exceptions=False) as test_client:
        yield test_client


def _error(response) -> dict:  # type: ignore[no-untyped-def]
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message", "details"}
    return body["error"]


def test_api_error_keeps_code_details_and_headers(client: TestClient) -> None:
    response = client.get("/teapot")
    assert response.status_code == 418
    assert response.headers["X-Extra"] == "1"
    assert _error(response) == {"code": "teapot", "message": "I am a teapot.", "details": {"why": "tests"}}


def test_validation_error_is_invalid_request_with_field_locations(client: TestClient) -> None:
    response = client.post("/echo", json={"text": "x", "unknown": 1})
    assert response.status_code == 422
    error = _error(response)
    assert error["code"] == "invalid_request"
    assert ["body", "unknown"] in [detail["loc"] for detail in error["details"]]


def test_the_message_names_the_first_problem_and_counts_the_rest(client: TestClient) -> None:
    """A CLI or a log shows the message alone: it says where the first problem is."""
    one = _error(client.post("/echo", json={"text": 3}))
    assert one["message"] == "The request is not valid: text: Input should be a valid string"
    empty = _error(client.post("/echo", content=b"", headers={"content-type": "application/json"}))
    assert empty["message"].startswith("The request is not valid: body: ")  # the place: the whole body
    two = _error(client.post("/echo", json={"text": 3, "unknown": 1}))
    assert two["message"].endswith("(+ 1 more in details)") and len(two["details"]) == 2


def test_a_body_sent_without_a_json_content_type_says_which_header(client: TestClient) -> None:
    """curl -d sends application/x-www-form-urlencoded: the JSON is then no object to the API."""
    form = client.post("/echo", content=b'{"text": "x"}',
                       headers={"content-type": "application/x-www-form-urlencoded"})
    assert form.status_code == 422
    message = _error(form)["message"]
    hint = "sent as application/x-www-form-urlencoded: send JSON with Content-Type: application/json"
    assert hint in message
    wrong_json = _error(client.post("/echo", json=[1]))["message"]
    assert "Content-Type" not in wrong_json  # JSON, only the wrong shape: no header hint


def test_malformed_json_is_invalid_request(client: TestClient) -> None:
    response = client.post("/echo", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert _error(response)["code"] == "invalid_request"


def test_unknown_route_and_method_use_the_error_shape(client: TestClient) -> None:
    assert _error(client.get("/nowhere"))["code"] == "not_found"
    response = client.delete("/echo")
    assert response.status_code == 405
    assert _error(response)["code"] == "method_not_allowed"


def test_declared_oversized_body_is_413_before_parsing(client: TestClient) -> None:
    response = client.post("/echo", content=b"x" * (LIMIT + 1), headers={"content-type": "application/json"})
    assert response.status_code == 413
    error = _error(response)
    assert error["code"] == "body_too_large"
    assert error["details"] == {"max_body_bytes": LIMIT, "setting": "CLOVERQ_MAX_BODY_BYTES"}
    assert f"larger than {LIMIT} bytes (CLOVERQ_MAX_BODY_BYTES)" in error["message"]


def test_streamed_oversized_body_without_length_is_413(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(10):
            yield b"x" * 512

    response = client.post("/echo", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert _error(response)["code"] == "body_too_large"


def test_body_at_the_limit_is_accepted(client: TestClient) -> None:
    text = "y" * (LIMIT - len('{"text":""}'))
    response = client.post("/echo", content=f'{{"text":"{text}"}}'.encode(),
                           headers={"content-type": "application/json"})
    assert response.status_code == 200


def test_database_connection_failure_is_503_unavailable(client: TestClient) -> None:
    response = client.get("/db-down")
    assert response.status_code == 503
    assert _error(response)["code"] == "unavailable"


def test_unexpected_exception_is_500_in_the_error_shape(client: TestClient) -> None:
    response = client.get("/bug")
    assert response.status_code == 500
    assert _error(response)["code"] == "internal_error"
