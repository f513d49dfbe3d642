"""Read tool calls out of a model's answer: one parser per call format, chosen from the template.

Two formats, both opened by ``<tool_call>`` and closed by ``</tool_call>``:

* ``qwen3_xml`` (Qwen3-Coder, Qwen3.5, Clover, the demo checkpoints)::

      <tool_call>
      <function=NAME>
      <parameter=KEY>
      VALUE
      </parameter>
      </function>
      </tool_call>

  A value is text: the newline after ``<parameter=KEY>`` and the one before ``</parameter>``
  belong to the format. It is typed by the tool's schema for that key (a string stays text;
  integer, number, boolean, null, array and object are read as JSON; ``True``/``False`` as
  Python writes them are booleans too, as some templates render them).
* ``hermes`` (Qwen2.5 / Qwen3, Hermes)::

      <tool_call>
      {"name": NAME, "arguments": {...}}
      </tool_call>

A call is **well formed** when its function is one of the request's tools and its arguments
validate against that tool's ``parameters`` (judged by ``jsonschema``). The answer's content is
the text outside the calls, stripped. Any malformed call (unknown function, arguments that do
not validate, a ``<tool_call>`` never closed) makes the whole answer malformed: no call is
returned and the content is the whole answer text (``ParsedCalls.malformed`` says why).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema

from scheduler.jobs.tool_spec import ToolSpec

CallFormat = Literal["qwen3_xml", "hermes"]
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.DOTALL)
_PYTHON_WORDS: dict[str, Any] = {"True": True, "False": False, "None": None}
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.DOTALL)


def call_format(chat_template: str | None) -> CallFormat | None:
    """The call format a chat template renders (``None``: it renders no tool calls)."""
    if not chat_template or OPEN not in chat_template:
        return None
    return "qwen3_xml" if "<function=" in chat_template else "hermes"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedCalls:
    """What an answer holds: its content (text outside the calls) and the calls."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)
    malformed: str | None = None  # why the calls were not returned (then content is the answer)


class _Malformed(ValueError):
    """Why a call is malformed. The reason is logged (``tool_call.invalid_model_output``), so it
    names the rule broken and never quotes the model's text."""


def _typed(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """One XML parameter value read by its schema: text for a string, JSON otherwise; where the
    schema allows both (no type, a type list with string, an enum), the JSON reading when it
    validates, else the text."""
    schema = schema or {}
    types = schema.get("type")
    kinds = set(types) if isinstance(types, list) else ({types} if isinstance(types, str) else set())
    if kinds == {"string"}:
        return raw
    text = raw.strip()
    if text in _PYTHON_WORDS and kinds & {"boolean", "null"}:
        return _PYTHON_WORDS[text]
    try:
        value = json.loads(text)
    except ValueError:
        if "string" in kinds or not kinds:
            return raw
        raise _Malformed(f"a parameter value is not {'/'.join(sorted(kinds))}") from None
    if ("string" in kinds or not kinds) and not jsonschema.Draft202012Validator(schema).is_valid(value):
        return raw
    return value


def _qwen3_xml(body: str, spec: ToolSpec) -> ParsedCall:
    match = _FUNCTION.fullmatch(body)
    if match is None:
        raise _Malformed("no <function=...>...</function> inside <tool_call>")
    name, inner = match.group(1).strip(), match.group(2)
    tool = spec.tool(name)
    properties = tool.schema.get("properties", {}) if tool is not None else {}
    arguments: dict[str, Any] = {}
    pos = 0
    for param in _PARAMETER.finditer(inner):
        if inner[pos:param.start()].strip():
            raise _Malformed("text between parameters")
        key = param.group(1).strip()
        arguments[key] = _typed(param.group(2), properties.get(key))
        pos = param.end()
    if inner[pos:].strip():
        raise _Malformed("text after the last parameter")
    return ParsedCall(name, arguments)


def _hermes(body: str, spec: ToolSpec) -> ParsedCall:
    try:
        doc = json.loads(body)
    except json.JSONDecodeError as exc:
        raise _Malformed(f"the call is not JSON: {exc.msg}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
        raise _Malformed('the call is not {"name": ..., "arguments": {...}}')
    arguments = doc.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise _Malformed("arguments are not a JSON object") from None
    if not isinstance(arguments, dict):
        raise _Malformed("arguments are not a JSON object")
    return ParsedCall(doc["name"], arguments)


PARSERS: dict[CallFormat, Callable[[str, ToolSpec], ParsedCall]] = {
    "qwen3_xml": _qwen3_xml, "hermes": _hermes,
}


def _checked(call: ParsedCall, spec: ToolSpec) -> ParsedCall:
    tool = spec.tool(call.name)
    if tool is None:
        raise _Malformed("the call names a function that is not one of the tools")
    try:
        jsonschema.validate(call.arguments, tool.schema)
    except jsonschema.ValidationError as exc:
        rule = f"'{exc.validator}' at {exc.json_path}"
        raise _Malformed(f"arguments of {call.name!r} do not validate: {rule}") from None
    return call


def parse_calls(text: str, spec: ToolSpec, fmt: CallFormat) -> ParsedCalls:
    """The calls in ``text`` (an answer, reasoning already split off) in format ``fmt``."""
    parser = PARSERS[fmt]
    outside: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    try:
        while (start := text.find(OPEN, pos)) >= 0:
            end = text.find(CLOSE, start)
            if end < 0:
                raise _Malformed("a <tool_call> is never closed")
            outside.append(text[pos:start])
            calls.append(_checked(parser(text[start + len(OPEN):end], spec), spec))
            pos = end + len(CLOSE)
    except _Malformed as exc:
        return ParsedCalls(text.strip(), [], str(exc))
    outside.append(text[pos:])
    if not spec.parallel:
        calls = calls[:1]
    return ParsedCalls("".join(outside).strip(), calls)
