"""``$ref`` inside one schema, inlined: the subset's parser, the tool-call parsers and the extract
prompt all read one tree without references.

pydantic's ``model_json_schema()`` (and so OpenAI's SDK, ``chat.completions.parse(...,
response_format=Model)`` and ``pydantic_function_tool``) writes every nested model once under the
root's ``$defs`` and refers to it with ``{"$ref": "#/$defs/Party"}``. :func:`inline_refs` returns
the schema with each such reference replaced by a copy of the subschema it points to (any JSON
pointer from ``#``; annotations written beside the ``$ref``, a field's ``description``, win over
the definition's) and the ``$defs`` / ``definitions`` containers dropped. It walks only the
subset's schema positions (``properties``, ``items``, ``anyOf``): a keyword outside the subset is
left as it is, for the parser to refuse by name.

Refused, each as a :class:`SchemaError` naming ``$ref`` (the API answers 400, never 500):

- a recursive reference (a tree, a linked list): the output is laid out as one fixed structure,
  ``unsupported_schema_keyword``; so is a reference to another document (nothing is fetched) or to
  an anchor (``#name``), and a keyword other than an annotation beside a ``$ref``;
- a pointer to nothing, or to something that is not a valid schema (a pointer into a ``const``
  value, say: the meta-schema check of the whole document never looked there), ``invalid_schema``;
- nesting past ``max_depth``, and a schema whose references expand to more than
  :data:`MAX_EXPANDED_NODES` subschemas (a few hundred bytes of definitions that refer to each
  other eight times over reach 8^6), ``schema_too_large``, before it expands.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

import jsonschema

from scheduler.jobs.schema_common import ANNOTATIONS, SchemaError, SchemaErrorCode, over_limit

DEFINITIONS = frozenset({"$defs", "definitions"})  # where definitions live; dropped once inlined
MAX_EXPANDED_NODES = 4096  # subschemas reached through references, in all
_INDEX = re.compile(r"0|[1-9][0-9]*")  # a JSON pointer's array index (RFC 6901)


def inline_refs(schema: Any, max_depth: int) -> Any:
    """``schema`` with every local ``$ref`` inlined (module docstring); raises :class:`SchemaError`."""
    return _Inliner(schema, max_depth).walk(schema, "#", 0, ())


class _Inliner:
    def __init__(self, root: Any, max_depth: int) -> None:
        self.root = root
        self.max_depth = max_depth
        self.expanded = 0  # subschemas visited inside a reference
        self.valid: set[str] = set()  # targets the meta-schema check passed

    def walk(self, schema: Any, path: str, depth: int, refs: tuple[str, ...]) -> Any:
        """The inlined copy of ``schema`` at ``path``; ``refs``: the references being expanded
        around it (a reference to one of them is recursive)."""
        if depth > self.max_depth:
            raise over_limit(f"nesting deeper than {self.max_depth}", "max_schema_depth",
                             "a flatter schema (fewer levels of nested objects, arrays and anyOf)", path)
        notes: dict[str, Any] = {}
        while isinstance(schema, dict) and "$ref" in schema:  # a chain of references, followed in place
            ref = schema["$ref"]
            self._check_site(schema, ref, path, refs)
            notes = {**{k: v for k, v in schema.items() if k in ANNOTATIONS}, **notes}  # the outer site wins
            refs = (*refs, ref)
            schema, path = self._target(ref, path), ref
        if refs:
            self.expanded += 1
            if self.expanded > MAX_EXPANDED_NODES:
                raise SchemaError(SchemaErrorCode.SCHEMA_TOO_LARGE,
                                  f"the schema's $refs expand to more than {MAX_EXPANDED_NODES} subschemas; "
                                  "refer to fewer definitions, fewer times", keyword="$ref", path=path)
        if not isinstance(schema, dict):
            return schema  # a boolean schema
        out = {k: v for k, v in schema.items() if k not in DEFINITIONS}
        out.update(notes)
        if isinstance(out.get("properties"), dict):
            out["properties"] = {name: self.walk(sub, f"{path}/properties/{name}", depth + 1, refs)
                                 for name, sub in out["properties"].items()}
        if isinstance(out.get("items"), dict | bool):
            out["items"] = self.walk(out["items"], f"{path}/items", depth + 1, refs)
        if isinstance(out.get("anyOf"), list):
            out["anyOf"] = [self.walk(sub, f"{path}/anyOf/{i}", depth + 1, refs)
                            for i, sub in enumerate(out["anyOf"])]
        return out

    @staticmethod
    def _check_site(schema: dict[str, Any], ref: Any, path: str, refs: tuple[str, ...]) -> None:
        def refused(message: str) -> SchemaError:
            return SchemaError(SchemaErrorCode.UNSUPPORTED_KEYWORD, message, keyword="$ref",
                               path=f"{path}/$ref")

        beside = sorted(k for k in schema if k != "$ref" and k not in ANNOTATIONS and k not in DEFINITIONS)
        if beside:
            raise refused(f"keywords next to $ref are not supported ({', '.join(beside)})")
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise refused(f"$ref {ref!r}: only references inside the schema ('#/$defs/...') are supported; "
                          "nothing is fetched")
        if ref != "#" and not ref.startswith("#/"):
            raise refused(f"$ref {ref!r}: anchors are not supported; use a JSON pointer ('#/$defs/...')")
        if ref in refs:
            raise refused(f"recursive $ref {ref!r}: the output is laid out as a fixed structure, so a schema "
                          "may not contain itself; unroll it to the depth you need")

    def _target(self, ref: str, path: str) -> Any:
        """The subschema at JSON pointer ``ref[1:]`` (percent-decoded, ``~1``/``~0`` unescaped)."""
        found: Any = self.root
        for token in unquote(ref[1:]).split("/")[1:]:
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(found, dict) and token in found:
                found = found[token]
            elif isinstance(found, list) and _INDEX.fullmatch(token) and int(token) < len(found):
                found = found[int(token)]
            else:
                found = None
                break
        if not isinstance(found, dict | bool):
            raise SchemaError(SchemaErrorCode.INVALID_SCHEMA, f"$ref {ref!r} points to no subschema",
                              keyword="$ref", path=f"{path}/$ref")
        if isinstance(found, dict) and ref not in self.valid:
            try:
                jsonschema.Draft202012Validator.check_schema(found)
            except jsonschema.SchemaError as exc:
                raise SchemaError(SchemaErrorCode.INVALID_SCHEMA,
                                  f"$ref {ref!r} points to no valid schema: {exc.message}",
                                  keyword="$ref", path=f"{path}/$ref") from None
            self.valid.add(ref)
        return found
