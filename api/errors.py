"""The one error shape of the API: ``{"error": {"code", "message", "details"}}``.

Clients branch on ``code`` (stable, snake_case), humans read ``message``, and ``details``
carries structured context (e.g. which field failed). Every failure path of the service goes
through :class:`ApiError` or one of the handlers below, so no client ever sees a framework's
default error body and no client mistake turns into a 5xx.

The OpenAI-compatible routes (:func:`openai_style` paths: ``/v1/chat/completions``,
``/v1/completions``, ``/v1/models``, ``/v1/files`` and everything under ``/openai/``) answer
the same errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with
the same stable ``code``; a request that is not valid is a 400 there (OpenAI's status for it)
where the job API answers 422.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = structlog.get_logger(__name__)

# HTTP status -> the code used when a framework-level HTTPException carries no code of its own.
_DEFAULT_CODES: Mapping[int, str] = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "body_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    429: "rate_limited",
    503: "unavailable",
}


class ApiError(Exception):
    """An error the API reports on purpose, with a stable ``code`` (``param``: the request field
    it is about, for the OpenAI shape; derived from ``details`` when not given)."""

    def __init__(
        self,
        status_code: int,
        code: str,
        message: str,
        details: Any = None,
        headers: Mapping[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.message = message
        self.details = details
        self.headers = dict(headers or {})
        self.param = param


# --- the OpenAI shape -----------------------------------------------------------------------------

OPENAI_PATH_PREFIXES: tuple[str, ...] = (
    "/openai/", "/v1/chat/", "/v1/completions", "/v1/models", "/v1/files",
)
OPENAI_ERROR_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


def openai_style(path: str) -> bool:
    """Whether errors on ``path`` take OpenAI's shape (the OpenAI-compatible routes)."""
    return path.startswith(OPENAI_PATH_PREFIXES)


def param_of(details: Any) -> str | None:
    """The request field a cloverq error's ``details`` point at, OpenAI style (``messages[0].content``)."""
    entries = details if isinstance(details, list) else [details]
    for entry in entries:
        loc = entry.get("loc") if isinstance(entry, Mapping) else None
        if not isinstance(loc, list | tuple):
            continue
        parts = [part for part in loc if part not in ("body", "query", "path", "header")]
        text = ""
        for part in parts:
            text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
        return text or None
    return None


def openai_error_body(status_code: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """The JSON body of an error on an OpenAI-compatible route."""
    fallback = "server_error" if status_code >= 500 else "invalid_request_error"
    error_type = OPENAI_ERROR_TYPES.get(status_code, fallback)
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


MAX_DETAIL_DEPTH = 16
MAX_DETAIL_INT_BITS = 256


def json_safe(value: Any, _depth: int = 0) -> Any:
    """``value`` reduced to what strict JSON can carry, for error bodies that echo client input.

    Non-finite floats become their names (``"nan"``, ``"inf"``), text with lone surrogates keeps
    them as ``\\udXXX`` escapes, huge integers and unknown types become strings, tuples and sets
    become lists, and nesting is cut at :data:`MAX_DETAIL_DEPTH` levels.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        bits = value.bit_length()
        return value if bits <= MAX_DETAIL_INT_BITS else f"<integer of {bits} bits>"
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        return value
    if _depth >= MAX_DETAIL_DEPTH:
        return "..."
    if isinstance(value, Mapping):
        return {json_safe(key if isinstance(key, str) else str(key)): json_safe(item, _depth + 1)
                for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(item, _depth + 1) for item in value]
    return json_safe(str(value))


class ErrorJSONResponse(JSONResponse):
    """The response of every error: rendered as is when it can be, else through :func:`json_safe`.

    Details echo client input (pydantic's ``input``, a field's ``value``), which may be NaN, text
    with a lone surrogate or a huge integer: none of them may turn an error into a 500.
    """

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except (TypeError, ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
            return super().render(json_safe(content))


def error_body(code: str, message: str, details: Any = None) -> dict[str, Any]:
    """The JSON body of every error response."""
    return {"error": {"code": code, "message": message, "details": details}}


def error_response(
    status_code: int,
    code: str,
    message: str,
    details: Any = None,
    headers: Mapping[str, str] | None = None,
    *,
    path: str | None = None,
    param: str | None = None,
) -> JSONResponse:
    """A JSONResponse in the error shape (rendered by :class:`ErrorJSONResponse`); in OpenAI's
    shape when ``path`` is an OpenAI-compatible route (422 answered as 400 there)."""
    if path is not None and openai_style(path):
        status = 400 if status_code == 422 else status_code
        body = openai_error_body(status, code, message, param if param is not None else param_of(details))
        return ErrorJSONResponse(body, status_code=status, headers=headers)
    return ErrorJSONResponse(error_body(code, message, details), status_code=status_code, headers=headers)


def _validation_message(err: Mapping[str, Any]) -> str:
    message = str(err.get("msg", ""))
    reason = (err.get("ctx") or {}).get("error") if err.get("type") == "json_invalid" else None
    return f"{message}: {reason}" if reason else message  # e.g. why api.json_input refused the body


def validation_details(errors: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Pydantic errors reduced to what a client needs: where, what, and the error type."""
    return [
        {"loc": list(err.get("loc", ())), "message": _validation_message(err), "type": err.get("type")}
        for err in errors
    ]


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status_code, exc.code, exc.message, exc.details, exc.headers,
                          path=request.url.path, param=exc.param)


RefusedRequestMeter = Callable[[Request], Awaitable[StarletteHTTPException | None]]
"""Spends a rate-limit token for a request refused before its route ran; returns the 401/429 to
answer instead, or None (``api.auth.meter_refused_request``). Passed in by ``create_app`` so that
``api.errors`` sits below ``api.auth`` (auth raises ``ApiError``) instead of importing it back."""


def _validation_handler(meter_refused: RefusedRequestMeter | None) -> Callable[
        [Request, Exception], Awaitable[JSONResponse]]:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        if meter_refused is not None:
            refused = await meter_refused(request)  # an invalid body spends its token too
            if refused is not None:
                return await _http_exception_handler(request, refused)
        return _validation_response(request, exc)

    return handle


def _validation_response(request: Request, exc: RequestValidationError) -> JSONResponse:
    details = validation_details(exc.errors())
    message = "The request is not valid."
    if openai_style(request.url.path) and details:  # OpenAI clients show only the message
        message = f"The request is not valid: {details[0]['message']}"
    elif details:  # the first problem where it is, so a CLI or a log line says what to fix
        summary = validation_summary(details, request.headers.get("content-type"))
        message = f"The request is not valid: {summary}"
    return error_response(422, "invalid_request", message, details, path=request.url.path)


def validation_summary(details: Sequence[Mapping[str, Any]], content_type: str | None) -> str:
    """``generate.input.prompt: <message>`` of the first problem (``+ N more in details``); a body
    that is no JSON object, sent without a JSON content type, says which header is missing (curl's
    ``-d`` sends a form type)."""
    first = details[0]
    loc = [str(part) for part in first.get("loc", ())]
    where = ".".join(loc[1:]) or ".".join(loc)  # past "body" / "query"; the whole body: "body"
    text = f"{where}: {first.get('message')}" if where else str(first.get("message"))
    json_type = (content_type or "").split(";")[0].strip().lower()
    if first.get("type") == "model_attributes_type" and len(loc) <= 1 and not json_type.endswith("json"):
        text += f" (sent as {json_type or 'no content type'}: send JSON with Content-Type: application/json)"
    more = len(details) - 1
    return text + (f" (+ {more} more in details)" if more else "")


async def _http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail
    path = request.url.path
    # Dependencies (e.g. auth) may raise HTTPException with detail already in our shape.
    if isinstance(detail, Mapping) and isinstance(detail.get("error"), Mapping):
        detail = detail["error"]
    if isinstance(detail, Mapping) and "code" in detail:
        return error_response(exc.status_code, str(detail["code"]), str(detail.get("message", "")),
                              detail.get("details"), exc.headers, path=path)
    if exc.status_code == 400 and isinstance(detail, str):
        # The framework's answer to a body it cannot parse (undecodable JSON, broken multipart):
        # the same client mistake as malformed JSON, which is a 422 ``invalid_request``.
        return error_response(422, "invalid_request", f"The request body cannot be parsed: {detail}",
                              [{"loc": ["body"], "message": detail, "type": "body_unparsable"}], path=path)
    code = _DEFAULT_CODES.get(exc.status_code, "error")
    return error_response(exc.status_code, code, str(detail), None, exc.headers, path=path)


async def _database_unavailable_handler(request: Request, exc: Exception) -> JSONResponse:
    # Connection-level failures only (see _is_connection_problem); anything else is a bug -> 500.
    log.warning("database_unavailable", error=type(exc).__name__)
    return error_response(503, "unavailable", "The database is not reachable; retry later.", None,
                          {"Retry-After": "1"}, path=request.url.path)


async def _data_error_handler(request: Request, exc: Exception) -> JSONResponse:
    # The database refused a value the request schema let through, e.g. a NUL character in a
    # string on PostgreSQL (a text column cannot hold U+0000): a client mistake, never a 5xx.
    log.info("request_data_refused_by_database", error=type(getattr(exc, "orig", exc)).__name__)
    return error_response(422, "invalid_request",
                          "The request holds a value that cannot be stored (e.g. a NUL character).",
                          [{"loc": ["body"], "message": "value cannot be stored", "type": "data_error"}],
                          path=request.url.path)


async def _unexpected_handler(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return await _database_unavailable_handler(request, exc)
    log.exception("unhandled_error", error=type(exc).__name__)
    return error_response(500, "internal_error", "An internal error occurred.", path=request.url.path)


def install_error_handlers(app: FastAPI, *, meter_refused: RefusedRequestMeter | None = None) -> None:
    """Route every exception type to the JSON error shape (``meter_refused``: see its type)."""
    app.add_exception_handler(ApiError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler(meter_refused))
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    app.add_exception_handler(DataError, _data_error_handler)
    app.add_exception_handler(OperationalError, _database_unavailable_handler)
    app.add_exception_handler(PoolTimeoutError, _database_unavailable_handler)
    app.add_exception_handler(Exception, _unexpected_handler)
