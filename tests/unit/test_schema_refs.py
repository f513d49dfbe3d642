"""``$ref`` inside one schema (what pydantic's ``model_json_schema()`` and OpenAI's SDK write for
nested models): laid out as the subschema it points to, the same tree as the schema written out
by hand; recursive, remote, dangling and constrained references are refused with a code, and a
schema whose references multiply is refused before it expands."""

from __future__ import annotations

from typing import Any, Literal

import pydantic
import pytest

from scheduler.jobs.schema_refs import MAX_EXPANDED_NODES, inline_refs
from scheduler.jobs.schema_subset import SchemaError, SchemaErrorCode, parse_schema


class Party(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    role: Literal["provider", "customer"]


class Contract(pydantic.BaseModel):
    parties: list[Party] = pydantic.Field(max_length=3)
    signer: Party = pydantic.Field(description="who signs")
    law: str | None = None


PARTY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "role": {"enum": ["provider", "customer"], "type": "string"}},
         "required": ["name", "role"]}
BY_HAND = {"type": "object",
           "properties": {"parties": {"type": "array", "items": PARTY, "maxItems": 3},
                          "signer": PARTY,
                          "law": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
           "required": ["parties", "signer"]}


def test_a_pydantic_model_with_nested_models_is_the_tree_written_out_by_hand() -> None:
    schema = Contract.model_json_schema()
    assert "$defs" in schema and schema["properties"]["signer"].get("description") == "who signs"
    assert parse_schema(schema) == parse_schema(BY_HAND)


def test_pointer_escapes_and_definitions_resolve() -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": "#/definitions/x~1y~0z"}},
              "definitions": {"x/y~z": {"type": "boolean"}}, "required": ["a"]}
    assert parse_schema(schema) == parse_schema({"type": "object", "properties": {"a": {"type": "boolean"}},
                                                 "required": ["a"]})


@pytest.mark.parametrize(
    ("schema", "code"),
    [
        # recursive: a canvas is a fixed layout
        ({"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
          "$ref": "#/$defs/node"}, SchemaErrorCode.UNSUPPORTED_KEYWORD),
        ({"type": "array", "items": {"$ref": "#"}}, SchemaErrorCode.UNSUPPORTED_KEYWORD),
        # another document: never fetched
        ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}},
         SchemaErrorCode.UNSUPPORTED_KEYWORD),
        # a constraint beside the reference
        ({"$defs": {"s": {"type": "string"}}, "type": "object",
          "properties": {"a": {"$ref": "#/$defs/s", "maxLength": 3}}}, SchemaErrorCode.UNSUPPORTED_KEYWORD),
        # points to nothing
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}, SchemaErrorCode.INVALID_SCHEMA),
        ({"type": "object", "properties": {"a": {"$ref": "#anchor"}}}, SchemaErrorCode.UNSUPPORTED_KEYWORD),
        # into data the meta-schema check never read, and an array index that is no index
        ({"$defs": {"a": {"const": {"type": "object", "properties": [1]}}}, "$ref": "#/$defs/a/const"},
         SchemaErrorCode.INVALID_SCHEMA),
        ({"type": "object", "properties": {"b": {"anyOf": [{"type": "null"}]},
                                           "c": {"$ref": "#/properties/b/anyOf/\u00b2"}}},
         SchemaErrorCode.INVALID_SCHEMA),
    ],
    ids=["recursive", "root", "remote", "sibling", "dangling", "anchor", "into-const", "odd-index"],
)
def test_references_outside_the_subset_are_refused(schema: dict[str, Any], code: SchemaErrorCode) -> None:
    with pytest.raises(SchemaError) as info:
        parse_schema(schema)
    assert info.value.code is code and info.value.keyword == "$ref"


def test_a_long_chain_of_references_is_followed_without_recursion() -> None:
    defs = {str(i): {"$ref": f"#/$defs/{i + 1}"} for i in range(500)} | {"500": {"type": "boolean"}}
    assert parse_schema({"$defs": defs, "$ref": "#/$defs/0"}) == parse_schema({"type": "boolean"})


def test_an_enum_beside_a_referenced_property_is_checked_against_the_whole_schema() -> None:
    schema = {"$defs": {"n": {"type": "integer"}},
              "type": "object", "properties": {"x": {"enum": [{"a": 1}, {"a": "no"}], "type": "object",
                                                     "properties": {"a": {"$ref": "#/$defs/n"}}}}}
    assert inline_refs(schema, 6)["properties"]["x"]["properties"]["a"] == {"type": "integer"}
    node = parse_schema(schema)
    assert node == parse_schema({"type": "object", "properties": {"x": {"enum": [{"a": 1}]}}})


def test_references_that_multiply_are_refused_before_they_expand() -> None:
    # each level refers to the next one 8 times: 8 ** 6 subschemas from a few hundred bytes
    defs: dict[str, Any] = {"l6": {"type": "boolean"}}
    for level in range(5, -1, -1):
        defs[f"l{level}"] = {"type": "object",
                             "properties": {f"p{i}": {"$ref": f"#/$defs/l{level + 1}"} for i in range(8)}}
    with pytest.raises(SchemaError) as info:
        parse_schema({"$defs": defs, "$ref": "#/$defs/l0"})
    assert info.value.code is SchemaErrorCode.SCHEMA_TOO_LARGE
    assert str(MAX_EXPANDED_NODES) in str(info.value)


def _factored(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with every subschema under properties/items/anyOf moved to the root's ``$defs``
    and referred to (every other one with a description beside its ``$ref``), as pydantic writes
    nested models: the same schema, spelled with references."""
    defs: dict[str, Any] = {}

    def moved(sub: Any) -> Any:
        if not isinstance(sub, dict):
            return sub
        name = f"d{len(defs)}"
        defs[name] = {}  # reserved before the walk below, so names follow the order of discovery
        defs[name] = walk(sub)
        ref: dict[str, Any] = {"$ref": f"#/$defs/{name}"}
        return ref | {"description": name} if len(defs) % 2 else ref

    def walk(node: dict[str, Any]) -> dict[str, Any]:
        out = dict(node)
        if isinstance(out.get("properties"), dict):
            out["properties"] = {k: moved(v) for k, v in out["properties"].items()}
        if "items" in out:
            out["items"] = moved(out["items"])
        if isinstance(out.get("anyOf"), list):
            out["anyOf"] = [moved(v) for v in out["anyOf"]]
        return out

    root = walk(schema)
    return {**root, "$defs": defs}


def test_three_hundred_random_schemas_spelled_with_references_parse_to_the_same_tree() -> None:
    """The property test's 300 random schemas (``tests/unit/test_structured_property.py`` decodes
    them on both families and judges every value with ``jsonschema``), each rewritten with every
    subschema behind a ``$ref``: each parses to the very tree its ref-free spelling does, so it
    gets the same canvas and the same judged validity."""
    from bench.structured_schemas import schema_batch

    schemas = schema_batch(seed=24, count=300, depth=4)
    factored = [_factored(s) for s in schemas]
    assert sum(len(f["$defs"]) for f in factored) > 1000
    for plain, spelled in zip(schemas, factored, strict=True):
        assert parse_schema(spelled) == parse_schema(plain)
