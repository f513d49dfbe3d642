"""Tools and ``tool_choice`` of a generate job, checked once with stable error codes.

A job's ``input.tools`` keeps OpenAI's shape (``[{"type": "function", "function": {"name",
"description", "parameters"}}]``) because that is exactly what a chat template receives (Hugging
Face's ``apply_chat_template(tools=...)``); ``input.tool_choice`` is ``"none"``, ``"auto"``,
``"required"`` or ``{"type": "function", "function": {"name": ...}}``.

It lives in the scheduler (pure Python) for the reason ``schema_subset`` does: the API refuses a
bad tool list at submit (400, nothing stored) and the worker reads the same parsed spec to lay
out a named call's canvas and to type the arguments it parses. A tool's ``parameters`` must be an
object schema inside the subset (``scheduler/jobs/schema_subset.py``): a named or ``required``
call lays its arguments out on the canvas, so an unsupported keyword is refused, never dropped.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from scheduler.jobs.schema_subset import ObjectNode, ParseOptions, SchemaError, parse_inlined

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})

Mode = Literal["none", "auto", "required", "named"]


class ToolErrorCode(enum.StrEnum):
    """Stable codes (the API's ``error.code``); a bad ``parameters`` schema keeps the
    ``SchemaErrorCode`` of the subset checker (``invalid_schema``, ...)."""

    INVALID_TOOLS = "invalid_tools"  # not a list of {"type": "function", "function": {...}}
    INVALID_TOOL_NAME = "invalid_tool_name"  # a name outside ^[a-zA-Z0-9_-]{1,64}$, or twice
    TOO_MANY_TOOLS = "too_many_tools"  # more than settings.limits.max_tools
    INVALID_TOOL_CHOICE = "invalid_tool_choice"  # not none/auto/required/{"type": "function", ...}
    UNKNOWN_TOOL = "unknown_tool"  # tool_choice names a tool that is not in tools


class ToolError(ValueError):
    """A tool list or choice the service refuses; ``param`` is the OpenAI parameter path
    (``tools[2].function.name``), ``code`` a ``ToolErrorCode`` or ``SchemaErrorCode`` value."""

    def __init__(self, code: str, message: str, *, param: str, keyword: str | None = None,
                 path: str | None = None, setting: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param
        self.keyword = keyword
        self.path = path
        self.setting = setting  # the environment variable of the limit that refused it

    def details(self) -> dict[str, Any]:
        out: dict[str, Any] = {"param": self.param}
        if self.path is not None:
            out.update(keyword=self.keyword, path=self.path)
        if self.setting is not None:
            out["setting"] = self.setting
        return out


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: ObjectNode  # parsed (the canvas of a named call; the types of parsed arguments)
    schema: dict[str, Any]  # as given, $refs inlined (the judge of parsed arguments)


@dataclass(frozen=True)
class ToolSpec:
    """The parsed ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of one job."""

    tools: tuple[Tool, ...]
    mode: Mode
    named: str | None = None  # the tool of mode "named"
    parallel: bool = True

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    @property
    def parses(self) -> bool:
        """Whether the output is read for calls (none: the tools are not even rendered)."""
        return bool(self.tools) and self.mode != "none"


def _tool(raw: Any, index: int, options: ParseOptions | None) -> Tool:
    where = f"tools[{index}]"
    if not isinstance(raw, Mapping) or raw.get("type") != "function" or not isinstance(raw.get("function"),
                                                                                        Mapping):
        raise ToolError(ToolErrorCode.INVALID_TOOLS, f"'{where}' must be {{\"type\": \"function\", "
                        "\"function\": {\"name\": ..., \"parameters\": ...}}", param=where)
    unknown = sorted(set(raw) - _TOOL_KEYS) or sorted(set(raw["function"]) - _FUNCTION_KEYS)
    if unknown:
        raise ToolError(ToolErrorCode.INVALID_TOOLS, f"'{where}' has an unknown field '{unknown[0]}'",
                        param=where)
    function = raw["function"]
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ToolError(ToolErrorCode.INVALID_TOOL_NAME, f"'{where}.function.name' must match "
                        "^[a-zA-Z0-9_-]{1,64}$", param=f"{where}.function.name")
    if not isinstance(function.get("description", ""), str):
        raise ToolError(ToolErrorCode.INVALID_TOOLS, f"'{where}.function.description' must be a string",
                        param=f"{where}.function.description")
    schema = function.get("parameters", EMPTY_PARAMETERS)
    param = f"{where}.function.parameters"
    try:
        node, inlined = parse_inlined(schema, options)
    except SchemaError as exc:
        raise ToolError(exc.code.value, f"'{param}': {exc}", param=param, keyword=exc.keyword,
                        path=exc.path, setting=exc.setting) from None
    if not isinstance(node, ObjectNode):
        raise ToolError("invalid_schema", f"'{param}' must be an object schema (\"type\": \"object\")",
                        param=param, keyword="type", path="#")
    # the judge keeps the schema's meaning with its $refs inlined: the XML parser types each
    # parameter by its own subschema, which a bare {"$ref": ...} would not tell it
    return Tool(name, node, inlined)


def _choice(raw: Any, names: Sequence[str]) -> tuple[Mode, str | None]:
    if raw is None:
        return ("auto" if names else "none"), None
    if raw in ("none", "auto", "required"):
        if raw != "none" and not names:
            raise ToolError(ToolErrorCode.INVALID_TOOL_CHOICE, f"'tool_choice' {raw!r} needs 'tools'",
                            param="tool_choice")
        return raw, None
    function = raw.get("function") if isinstance(raw, Mapping) and raw.get("type") == "function" else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise ToolError(ToolErrorCode.INVALID_TOOL_CHOICE, "'tool_choice' must be 'none', 'auto', "
                        "'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        param="tool_choice")
    if name not in names:
        raise ToolError(ToolErrorCode.UNKNOWN_TOOL, f"'tool_choice' names the function {name!r}, which is "
                        "not in 'tools'", param="tool_choice.function.name")
    return "named", name


def parse_tools(tools: Any, tool_choice: Any = None, parallel_tool_calls: bool | None = None, *,
                max_tools: int, options: ParseOptions | None = None) -> ToolSpec:
    """The checked spec (raises :class:`ToolError`). Without ``tools`` the choice may only be
    ``none`` (or absent): there is nothing to call."""
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ToolError(ToolErrorCode.INVALID_TOOLS, "'tools' must be a list", param="tools")
    if len(tools) > max_tools:
        raise ToolError(ToolErrorCode.TOO_MANY_TOOLS, f"'tools' holds {len(tools)} functions; the limit is "
                        f"{max_tools} (CLOVERQ_MAX_TOOLS). Instead: send only the tools this turn may "
                        "need; or ask the operator to raise CLOVERQ_MAX_TOOLS", param="tools",
                        setting="CLOVERQ_MAX_TOOLS")
    parsed: list[Tool] = []
    for index, raw in enumerate(tools):
        tool = _tool(raw, index, options)
        if any(t.name == tool.name for t in parsed):
            raise ToolError(ToolErrorCode.INVALID_TOOL_NAME, f"'tools' names the function {tool.name!r} "
                            "twice", param=f"tools[{index}].function.name")
        parsed.append(tool)
    mode, named = _choice(tool_choice, [t.name for t in parsed])
    return ToolSpec(tuple(parsed), mode, named, parallel=parallel_tool_calls is not False)
