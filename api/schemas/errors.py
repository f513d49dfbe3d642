"""The error body, as a model, so OpenAPI documents it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    """What went wrong: a stable ``code``, a human ``message`` and structured ``details``."""

    code: str
    message: str
    details: Any = None


class ErrorResponse(BaseModel):
    """Every error response of the API has this shape."""

    error: ErrorInfo


def error_responses(*status_codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` entries documenting the error shape for the given statuses."""
    return {code: {"model": ErrorResponse} for code in status_codes}
