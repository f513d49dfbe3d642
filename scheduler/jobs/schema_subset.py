"""The supported JSON Schema subset, parsed into a small tree the canvas lays out.

A keyword outside the subset is an error naming it (never a silent drop); annotations (title,
description, ...) are accepted and ignored. ``$ref`` to a subschema of the same document
(``#/$defs/Party``, what pydantic writes for nested models; any JSON pointer starting with ``#``)
is laid out as the subschema it points to; a recursive one is refused (a canvas is a fixed
layout), as is one to another document (nothing is ever fetched).
``enum``/``const``/``boolean``/``null`` and integers over a small range all become one node,
:class:`EnumNode` (a choice among values), so ``anyOf`` of those merges into one choice. The
schema itself is first checked with ``jsonschema`` (draft 2020-12 meta-schema); enum values are
kept only if ``jsonschema`` says they satisfy the whole schema, so an enum that contradicts its
``type`` cannot produce an invalid value.

It lives in the scheduler (pure Python and ``jsonschema``; no torch) because both sides need it:
the API refuses a schema outside the subset at submit (400, nothing stored) and the worker's
canvas compiler (``worker/structured``) lays the parsed tree out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jsonschema

from scheduler.jobs.schema_common import ANNOTATIONS, SchemaError, SchemaErrorCode, over_limit
from scheduler.jobs.schema_refs import inline_refs

if TYPE_CHECKING:
    from scheduler.infra.settings import Settings


KEYWORDS = frozenset(
    {
        "type",
        "enum",
        "const",
        "anyOf",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
    }
)
TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
FORMATS = frozenset({"date"})


@dataclass(frozen=True)
class ParseOptions:
    """Limits of the subset (``settings.limits.max_schema_bytes`` / ``max_schema_depth`` fill them)."""

    max_depth: int = 6  # nesting of objects/arrays/anyOf
    enum_max: int = 128  # integers over at most this many values become a choice
    max_schema_bytes: int = 16384


def parse_options(settings: Settings) -> ParseOptions:
    """The deployment's limits (``settings.limits``): the API and the worker check the same ones."""
    return ParseOptions(
        max_depth=settings.limits.max_schema_depth, max_schema_bytes=settings.limits.max_schema_bytes
    )


@dataclass(frozen=True)
class EnumNode:
    values: tuple[Any, ...]  # JSON values; one value is a constant (no slot)


@dataclass(frozen=True)
class StringNode:
    min_length: int
    max_length: int | None
    date: bool  # format: date (YYYY-MM-DD)


@dataclass(frozen=True)
class IntegerNode:
    lo: int | None  # inclusive
    hi: int | None


@dataclass(frozen=True)
class NumberNode:
    lo: float | None
    hi: float | None
    lo_exclusive: bool
    hi_exclusive: bool


@dataclass(frozen=True)
class ArrayNode:
    item: Node
    min_items: int
    max_items: int | None


@dataclass(frozen=True)
class Property:
    name: str
    node: Node
    required: bool


@dataclass(frozen=True)
class ObjectNode:
    properties: tuple[Property, ...]
    free: bool  # no properties and additional ones allowed: free string key/value pairs


@dataclass(frozen=True)
class AnyOfNode:
    branches: tuple[Node, ...]


Node = EnumNode | StringNode | IntegerNode | NumberNode | ArrayNode | ObjectNode | AnyOfNode


def parse_schema(schema: Any, options: ParseOptions | None = None) -> Node:
    """Check ``schema`` against the subset and the limits; raises :class:`SchemaError`."""
    return parse_inlined(schema, options)[0]


def parse_inlined(schema: Any, options: ParseOptions | None = None) -> tuple[Node, Any]:
    """:func:`parse_schema`, and the schema with its ``$ref``s inlined (the tree it parsed; a tool's
    judge of parsed arguments reads it)."""
    opts = options or ParseOptions()
    if not isinstance(schema, dict):
        raise SchemaError(SchemaErrorCode.INVALID_SCHEMA, "a schema must be a JSON object")
    size = len(json.dumps(schema, ensure_ascii=False).encode())
    if size > opts.max_schema_bytes:
        raise over_limit(f"schema is {size} bytes; the limit is {opts.max_schema_bytes} bytes",
                         "max_schema_bytes",
                         "a smaller schema (fewer properties, shorter descriptions and enums)")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "#/" + "/".join(str(p) for p in exc.path)
        raise SchemaError(
            SchemaErrorCode.INVALID_SCHEMA, f"not a valid JSON Schema: {exc.message}", path=where
        ) from None
    try:
        # $refs first (schema_refs.py): the parser below, and everything after it, sees one tree
        inlined = inline_refs(schema, opts.max_depth)
        return _Parser(opts).node(inlined, "#", 0), inlined
    except RecursionError:  # the depth limits keep far below it; a backstop, never a 500
        raise over_limit("the schema nests too deeply", "max_schema_depth",
                         "a flatter schema (fewer levels of nested objects, arrays and anyOf)") from None


class _Parser:
    def __init__(self, opts: ParseOptions) -> None:
        self.opts = opts

    def node(self, schema: Any, path: str, depth: int) -> Node:
        if schema is True or schema == {}:
            return StringNode(0, None, False)  # any value is valid: lay out a string
        if not isinstance(schema, dict):
            raise SchemaError(SchemaErrorCode.UNSUPPORTED_KEYWORD, "boolean schema false", path=path)
        if depth > self.opts.max_depth:
            raise over_limit(f"nesting deeper than {self.opts.max_depth}", "max_schema_depth",
                             "a flatter schema (fewer levels of nested objects, arrays and anyOf)", path)
        for key in schema:
            if key not in KEYWORDS and key not in ANNOTATIONS:
                raise SchemaError(
                    SchemaErrorCode.UNSUPPORTED_KEYWORD,
                    f"schema keyword {key!r} is not supported",
                    keyword=key,
                    path=f"{path}/{key}",
                )
        if "const" in schema or "enum" in schema:
            return self._enum(schema, path)
        if "anyOf" in schema:
            rest = {k: v for k, v in schema.items() if k != "anyOf" and k not in ANNOTATIONS}
            if rest:
                raise SchemaError(
                    SchemaErrorCode.UNSUPPORTED_KEYWORD,
                    "anyOf next to other keywords is not supported",
                    keyword="anyOf",
                    path=path,
                )
            branches = [self.node(b, f"{path}/anyOf/{i}", depth + 1) for i, b in enumerate(schema["anyOf"])]
            return self._any_of(branches)
        kind = schema.get("type")
        if isinstance(kind, list):
            if not kind:
                raise SchemaError(SchemaErrorCode.INVALID_SCHEMA, "type is an empty list", path=path)
            branches = [self.node({**schema, "type": t}, path, depth + 1) for t in kind]
            return branches[0] if len(branches) == 1 else self._any_of(branches)
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
        return {
            "object": self._object,
            "array": self._array,
            "string": self._string,
            "integer": self._integer,
            "number": self._number,
        }.get(kind, self._scalar)(schema, path, depth)

    def _any_of(self, branches: list[Node]) -> Node:
        if all(isinstance(b, EnumNode) for b in branches):
            values: list[Any] = []
            for b in branches:
                assert isinstance(b, EnumNode)
                values.extend(v for v in b.values if not any(_same(v, w) for w in values))
            return EnumNode(tuple(values))
        return AnyOfNode(tuple(branches))

    def _enum(self, schema: dict[str, Any], path: str) -> Node:
        values = [schema["const"]] if "const" in schema else list(schema["enum"])
        kept = [v for v in values if jsonschema.Draft202012Validator(schema).is_valid(v)]
        if not kept:
            raise SchemaError(
                SchemaErrorCode.INVALID_SCHEMA, "no enum/const value satisfies the schema", path=path
            )
        return EnumNode(tuple(kept))

    def _scalar(self, schema: dict[str, Any], path: str, depth: int) -> Node:
        kind = schema["type"]
        if kind == "boolean":
            return EnumNode((True, False))
        if kind == "null":
            return EnumNode((None,))
        raise SchemaError(SchemaErrorCode.INVALID_SCHEMA, f"unknown type {kind!r}", keyword="type", path=path)

    def _object(self, schema: dict[str, Any], path: str, depth: int) -> Node:
        props = schema.get("properties", {})
        additional = schema.get("additionalProperties", True)
        if not isinstance(additional, bool):
            raise SchemaError(
                SchemaErrorCode.UNSUPPORTED_KEYWORD,
                "additionalProperties must be true or false here",
                keyword="additionalProperties",
                path=f"{path}/additionalProperties",
            )
        required = list(dict.fromkeys(schema.get("required", [])))
        out = [
            Property(name, self.node(sub, f"{path}/properties/{name}", depth + 1), name in required)
            for name, sub in props.items()
        ]
        for name in required:
            if name not in props:
                if not additional:
                    raise SchemaError(
                        SchemaErrorCode.INVALID_SCHEMA,
                        f"required property {name!r} is not allowed (additionalProperties is false)",
                        path=path,
                    )
                out.append(Property(name, StringNode(0, None, False), True))
        return ObjectNode(tuple(out), free=not out and additional)

    def _array(self, schema: dict[str, Any], path: str, depth: int) -> Node:
        item = self.node(schema.get("items", {}), f"{path}/items", depth + 1)
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        if hi is not None and lo > hi:
            raise SchemaError(SchemaErrorCode.INVALID_SCHEMA, "minItems > maxItems", path=path)
        return ArrayNode(item, lo, hi)

    def _string(self, schema: dict[str, Any], path: str, depth: int) -> Node:
        fmt = schema.get("format")
        if fmt is not None and fmt not in FORMATS:
            raise SchemaError(
                SchemaErrorCode.UNSUPPORTED_KEYWORD,
                f"format {fmt!r} is not supported (only 'date')",
                keyword="format",
                path=f"{path}/format",
            )
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if hi is not None and lo > hi:
            raise SchemaError(SchemaErrorCode.INVALID_SCHEMA, "minLength > maxLength", path=path)
        if fmt == "date" and (lo > 10 or (hi is not None and hi < 10)):
            raise SchemaError(SchemaErrorCode.INVALID_SCHEMA, "a date has 10 characters", path=path)
        return StringNode(lo, hi, fmt == "date")

    def _integer(self, schema: dict[str, Any], path: str, depth: int) -> Node:
        lo, hi = _bounds(schema)
        ilo = (
            None
            if lo is None
            else math.floor(lo[0]) + 1
            if lo[1] or lo[0] != math.floor(lo[0])
            else int(lo[0])
        )
        ihi = (
            None if hi is None else math.ceil(hi[0]) - 1 if hi[1] or hi[0] != math.ceil(hi[0]) else int(hi[0])
        )
        if ilo is not None and ihi is not None:
            if ilo > ihi:
                raise SchemaError(
                    SchemaErrorCode.INVALID_SCHEMA, "no integer lies within the bounds", path=path
                )
            if ihi - ilo + 1 <= self.opts.enum_max:
                return EnumNode(tuple(range(ilo, ihi + 1)))
        return IntegerNode(ilo, ihi)

    def _number(self, schema: dict[str, Any], path: str, depth: int) -> Node:
        lo, hi = _bounds(schema)
        if lo is not None and hi is not None and (lo[0] > hi[0] or (lo[0] == hi[0] and (lo[1] or hi[1]))):
            raise SchemaError(SchemaErrorCode.INVALID_SCHEMA, "no number lies within the bounds", path=path)
        return NumberNode(
            None if lo is None else lo[0],
            None if hi is None else hi[0],
            lo is not None and lo[1],
            hi is not None and hi[1],
        )


def _bounds(schema: dict[str, Any]) -> tuple[tuple[float, bool] | None, tuple[float, bool] | None]:
    """(value, exclusive) of the tightest lower and upper bounds, or None."""
    lows = [(float(schema["minimum"]), False)] if "minimum" in schema else []
    if "exclusiveMinimum" in schema:
        lows.append((float(schema["exclusiveMinimum"]), True))
    highs = [(float(schema["maximum"]), False)] if "maximum" in schema else []
    if "exclusiveMaximum" in schema:
        highs.append((float(schema["exclusiveMaximum"]), True))
    lo = max(lows, key=lambda b: (b[0], b[1])) if lows else None
    hi = min(highs, key=lambda b: (b[0], not b[1])) if highs else None
    return lo, hi


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b
