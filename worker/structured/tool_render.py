"""Tools between a job and a chat template: the messages a template iterates, the canvas of a
named call in the checkpoint's format, and calls in OpenAI's shape.

Pure (no engine): ``worker/tool_job.py`` runs the requests these build.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from scheduler.jobs.tool_spec import Tool
from worker.structured.canvas import Canvas, CanvasOptions, compile_canvas, compile_choice
from worker.structured.tool_parsers import CallFormat, ParsedCall
from worker.structured.vocab import CanvasTokenizer

# (prefix before the function name, text between the name and the arguments, suffix)
_CALL_TEXT: dict[CallFormat, tuple[str, str, str]] = {
    "qwen3_xml": ("<tool_call>\n<function=", ">\n", "</function>\n</tool_call>"),
    "hermes": ('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>"),
}


def _arguments(function: Mapping[str, Any]) -> Any:
    arguments = function.get("arguments")
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as a chat template reads them: an assistant call's ``arguments`` as a
    mapping (templates iterate it, e.g. the Qwen3 XML ``<parameter=...>`` blocks), not OpenAI's
    JSON text, as vLLM and Hugging Face callers pass them."""
    out = []
    for message in messages:
        turn = dict(message)
        if turn.get("tool_calls"):
            turn["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": _arguments(call["function"])}}
                for call in turn["tool_calls"]
            ]
        out.append(turn)
    return out


def call_canvas(tool: Tool, fmt: CallFormat, tokenizer: CanvasTokenizer,
                options: CanvasOptions | None = None) -> Canvas:
    """A call of ``tool`` laid out in ``fmt``: the tags and the name given, the arguments slots
    (valid against the tool's parameters by construction; raises ``SchemaError``)."""
    before, between, after = _CALL_TEXT[fmt]
    style: Literal["json", "xml"] = "xml" if fmt == "qwen3_xml" else "json"
    return compile_canvas(tool.parameters, tokenizer, options, style=style,
                          prefix=before + tool.name + between, suffix=after)


def name_canvas(names: Sequence[str], fmt: CallFormat, tokenizer: CanvasTokenizer) -> Canvas:
    """The opening of a call up to its function name, the name a choice among ``names``."""
    before, between, _after = _CALL_TEXT[fmt]
    return compile_choice(names, tokenizer, prefix=before, suffix=between)


def call_id(job_id: str, index: int) -> str:
    """A stable id per (job, call): a redelivered job writes the same ids."""
    return "call_" + hashlib.sha256(f"{job_id}:{index}".encode()).hexdigest()[:24]


def openai_calls(calls: Sequence[ParsedCall], job_id: str) -> list[dict[str, Any]]:
    """``result.tool_calls``: OpenAI's shape, ``arguments`` as JSON text."""
    return [{"id": call_id(job_id, i), "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
            for i, call in enumerate(calls)]
