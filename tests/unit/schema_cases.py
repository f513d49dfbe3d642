"""JSON Schemas outside the supported subset, with the 400 each must give: ``(schema, code,
keyword, path)``. Shared by the tests of the job API's ``response_schema`` and of the extract
job's ``input.schema``, so that both refuse the same inputs the same way."""

from __future__ import annotations

from typing import Any

OUTSIDE_THE_SUBSET: list[tuple[dict[str, Any], str, str | None, str]] = [
    ({"type": "string", "pattern": "^a$"}, "unsupported_schema_keyword", "pattern", "#/pattern"),
    # a recursive $ref (one into the schema's own $defs is laid out: test_schema_refs.py)
    ({"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}}, "unsupported_schema_keyword",
     "$ref", "#/properties/a/$ref"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "invalid_schema", None, "#"),
    ({"type": "integer", "minimum": "one"}, "invalid_schema", None, "#/minimum"),
]
