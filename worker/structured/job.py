"""Run a structured request through the engine: canvas after the prompt, value read back.

``response_schema`` in a generate job's input (what ``response_format`` will map to) makes the
job's text the JSON of a value valid against the schema by construction. A schema the canvas
cannot lay out is the caller's input problem: the API refuses it at submit (400 with the
``SchemaError`` code); one that passes there but not here (the canvas-token limit) fails the job
with ``invalid_input``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from scheduler.jobs.schema_subset import ParseOptions, parse_schema
from worker.engine.types import GenerationRequest, GenerationResult
from worker.structured.canvas import Canvas, CanvasOptions, ReadResult, compile_canvas
from worker.structured.vocab import CanvasTokenizer


def structured_request(
    request: GenerationRequest,
    schema: Any,
    tokenizer: CanvasTokenizer,
    options: CanvasOptions | None = None,
    limits: ParseOptions | None = None,
) -> tuple[GenerationRequest, Canvas]:
    """``request`` with the schema's canvas as its template (raises ``SchemaError``)."""
    canvas = compile_canvas(parse_schema(schema, limits), tokenizer, options)
    return replace(request, template=canvas.template), canvas


def read_structured(canvas: Canvas, result: GenerationResult, tokenizer: CanvasTokenizer) -> ReadResult:
    return canvas.read(result.slot_choices, tokenizer)
