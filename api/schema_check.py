"""A job's JSON Schema checked at submit: ``generate``'s ``input.response_schema`` and
``extract``'s ``input.schema``.

The same checker the worker runs (``scheduler.jobs.schema_subset``), so an accepted schema
decodes; a refusal is a 400 with the ``SchemaError`` code and ``loc`` naming the field.
"""

from __future__ import annotations

from typing import Any

from api.errors import ApiError
from scheduler.infra.settings import Settings
from scheduler.jobs.schema_subset import SchemaError, parse_options, parse_schema


def check_schema(schema: Any, *, settings: Settings, field: str) -> None:
    """400 with the ``SchemaError`` code (``invalid_schema``, ``unsupported_schema_keyword``,
    ``schema_too_large``) when ``input.<field>`` is outside the subset the worker's canvas lays
    out, or over ``settings.limits.max_schema_bytes`` / ``max_schema_depth``."""
    if schema is None:
        return
    try:
        parse_schema(schema, parse_options(settings))
    except SchemaError as exc:
        message = f"input.{field}: {exc}."
        raise ApiError(400, exc.code.value, message,
                       [{"loc": ["body", "input", field], "message": str(exc),
                         "type": exc.code.value, **exc.details()}]) from None
