"""The prompt of an ``extract`` job: a fixed system turn, the document, then what to extract.

Both sides build it from here, so they agree on it: the worker renders these messages through
the checkpoint's chat template (``worker/extract_job.py``), the API counts their text against
``max_prompt_tokens`` (``api/extract_limits.py``). Pure Python, no tokenizer.

**The document comes first.** Everything before it (the system turn, ``Document:``) is fixed, and
everything that differs between jobs (the instructions, the fields wanted) comes after it. So
every extract job over one document has the same tokens up to the document's end, and the
engine's prefix cache, which keys prompts by whole blocks from position 0
(``worker/engine/prefix_cache.py``), prefills the document once for many schemas.

The field list only sets the scene: the answer's structure and types are enforced by the
schema's canvas (``worker/structured``), never by this wording.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

from scheduler.jobs.schema_common import SchemaError
from scheduler.jobs.schema_refs import inline_refs

SYSTEM_PROMPT = "You extract facts from documents. Answer with JSON only."
DEFAULT_INSTRUCTIONS = "Extract the fields below from the document."
MAX_ENUM_SHOWN = 12  # enum values listed per field; more are summarised ("... N more")
MAX_FIELD_DEPTH = 3  # nested object fields listed; deeper ones are described as "object"


def extract_messages(context: str, schema: Any, instructions: str | None = None) -> list[dict[str, str]]:
    """Chat messages of an extract job, document first (see the module docstring)."""
    ask = (instructions or "").strip() or DEFAULT_INSTRUCTIONS
    user = f"Document:\n{context}\n\n{ask}\n\nAnswer with JSON holding:\n{render_fields(schema)}"
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def render_fields(schema: Any) -> str:
    """A short rendering of the value wanted: one line per field (``- name: type, bounds —
    description``, nested objects indented), or one line for a schema that is not an object.
    ``$ref``s are inlined first (a pydantic model's nested models are fields, not "text"); a
    schema whose references are refused is rendered as given (the job fails on it anyway)."""
    with contextlib.suppress(SchemaError):  # the limits were checked at submit; this only reads
        schema = inline_refs(schema, max_depth=64)
    if isinstance(schema, Mapping) and isinstance(schema.get("properties"), Mapping) and schema["properties"]:
        return "\n".join(_field_lines(schema, 0))
    return f"- {_describe(schema)}"


def _field_lines(schema: Mapping[str, Any], depth: int) -> list[str]:
    required = set(schema.get("required") or ())
    lines = []
    for name, sub in schema["properties"].items():
        optional = "" if name in required else " (optional)"
        lines.append(f"{'  ' * depth}- {name}{optional}: {_describe(sub)}")
        nested = isinstance(sub, Mapping) and isinstance(sub.get("properties"), Mapping)
        if nested and sub["properties"] and depth + 1 < MAX_FIELD_DEPTH:
            lines.extend(_field_lines(sub, depth + 1))
    return lines


def _describe(schema: Any) -> str:
    if not isinstance(schema, Mapping) or not schema:
        return "any value"
    note = schema.get("description") or schema.get("title")
    text = _kind(schema)
    return f"{text} — {note}" if isinstance(note, str) and note.strip() else text


def _kind(schema: Mapping[str, Any]) -> str:
    if "const" in schema:
        return f"exactly {json.dumps(schema['const'], ensure_ascii=False)}"
    if isinstance(schema.get("enum"), list):
        values = [json.dumps(v, ensure_ascii=False) for v in schema["enum"]]
        more = len(values) - MAX_ENUM_SHOWN
        return "one of " + ", ".join(values[:MAX_ENUM_SHOWN]) + (f", ... {more} more" if more > 0 else "")
    if isinstance(schema.get("anyOf"), list):
        return " or ".join(_describe(branch) for branch in schema["anyOf"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join(_kind({**schema, "type": k}) for k in kind)
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    if kind == "string":
        if schema.get("format") == "date":
            return "date (YYYY-MM-DD)"
        return "text" + _bounds(schema, "minLength", "maxLength", " characters")
    if kind in ("integer", "number"):
        return kind + _range(schema)
    if kind == "array":
        items = _describe(schema.get("items", {}))
        return f"list of {items}" + _bounds(schema, "minItems", "maxItems", " items")
    if kind == "boolean":
        return "true or false"
    return str(kind)  # object, null


def _bounds(schema: Mapping[str, Any], low: str, high: str, unit: str) -> str:
    lo, hi = schema.get(low), schema.get(high)
    if lo and hi is not None:
        return f", {lo} to {hi}{unit}"
    if hi is not None:
        return f", at most {hi}{unit}"
    return f", at least {lo}{unit}" if lo else ""


def _range(schema: Mapping[str, Any]) -> str:
    words = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}
    parts = [f"{word} {schema[key]}" for key, word in words.items() if key in schema]
    return f", {' and '.join(parts)}" if parts else ""
