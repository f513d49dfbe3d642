"""Valid by construction: 300 seeded random JSON Schemas decoded on the random demo weights of
both families, every output parses and validates (judged by ``jsonschema`` with format checks),
both as ``response_format`` output and as the arguments of a named tool call laid out in the call
format the family's chat template writes (``worker/structured/tool_render.py``, as a named or
``required`` ``tool_choice`` runs it).

Random weights carry no meaning, only structure: whatever the model prefers, the canvas only
lets it write values the schema accepts. The raw slot tokens are checked too, so a broken
pad-tail rule (a pad in the middle of a string) cannot hide behind the reader stripping pads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from bench.structured_schemas import schema_batch
from scheduler.jobs.schema_subset import ANNOTATIONS, KEYWORDS, ObjectNode, parse_schema
from scheduler.jobs.tool_spec import Tool
from worker.engine.engine import Engine, EngineConfig
from worker.engine.types import GenerationRequest, SamplingParams
from worker.model.checkpoint import LoadedModel, load_checkpoint
from worker.model.tokenizer import Tokenizer
from worker.structured.canvas import Canvas, CanvasOptions, compile_canvas
from worker.structured.tool_parsers import call_format
from worker.structured.tool_render import call_canvas

SCHEMAS = schema_batch(seed=24, count=300, depth=4)
OPTIONS = CanvasOptions(string_tokens=4, array_items=2, integer_digits=3, enum_max=16)


def _keywords(schema: object) -> set[str]:
    found: set[str] = set()
    if isinstance(schema, dict):
        for key, value in schema.items():
            found.add(key)
            if key == "properties":
                for sub in value.values():
                    found |= _keywords(sub)
            elif key in ("items",):
                found |= _keywords(value)
            elif key == "anyOf":
                for sub in value:
                    found |= _keywords(sub)
    return found


def test_the_generator_covers_every_supported_keyword_and_depth_four() -> None:
    seen = set().union(*(_keywords(s) for s in SCHEMAS))
    assert seen >= KEYWORDS  # every keyword the subset accepts
    assert seen <= KEYWORDS | ANNOTATIONS  # and none it refuses

    def depth(s: object) -> int:
        if not isinstance(s, dict):
            return 0
        subs = list(s.get("properties", {}).values()) + ([s["items"]] if "items" in s else [])
        return (1 + max(map(depth, subs), default=0)) if s.get("type") in ("object", "array") else 0

    assert max(depth(s) for s in SCHEMAS) >= 4


def tok_mask(lm: LoadedModel) -> int:
    assert lm.config.mask_token_id is not None
    return lm.config.mask_token_id


@pytest.fixture(scope="module", params=["clover", "sdar"])
def family_engine(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, Tokenizer]]:
    path: Path = request.getfixturevalue(
        "demo_checkpoint" if request.param == "clover" else "sdar_checkpoint"
    )
    lm = load_checkpoint(path)
    engine = Engine(
        lm.model,
        EngineConfig(max_batch=32, max_len=1024),
        mask_token_id=tok_mask(lm),
        eos_token_ids=lm.config.eos_token_ids,
        default_block_size=lm.config.block_size,
    )
    engine.start()
    yield engine, Tokenizer.from_dir(path)
    engine.stop()


def _decode_and_judge(engine: Engine, tok: Tokenizer, canvases: list[Canvas], prompt: str) -> int:
    """Decode every canvas after ``prompt`` (sampled, seeded), check the raw pad-tail slots and
    judge each value read back against its schema; returns the number of pad-tail slots checked."""
    ids = tok.encode(prompt)
    futures = [
        engine.submit(GenerationRequest(f"schema-{i}", ids, SamplingParams(temperature=0.7, seed=i),
                                        template=c.template))
        for i, c in enumerate(canvases)
    ]
    valid = 0
    pad = tok.pad_token_id
    tails_checked = 0
    for schema, canvas, future in zip(SCHEMAS, canvases, futures, strict=True):
        result = future.result(timeout=300)
        assert result.error is None
        for slot, choice in zip(canvas.template.slots, result.slot_choices, strict=True):
            if slot.pad_tail:  # content* pad*, at least min_tokens content tokens
                ids = choice.token_ids
                content = len(ids) - sum(1 for t in ids if t == pad)
                assert all(t != pad for t in ids[:content]) and all(t == pad for t in ids[content:])
                assert content >= slot.min_tokens
                tails_checked += 1
        out = canvas.read(result.slot_choices, tok)
        value = json.loads(out.text)
        assert value == out.value
        jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(value)
        valid += 1
    assert valid == len(SCHEMAS) == 300
    return tails_checked


def test_three_hundred_random_schemas_parse_and_validate(family_engine: tuple[Engine, Tokenizer]) -> None:
    engine, tok = family_engine
    canvases = [compile_canvas(parse_schema(s), tok, OPTIONS) for s in SCHEMAS]
    assert _decode_and_judge(engine, tok, canvases, "Reply with the JSON object.") > 100


def test_three_hundred_random_schemas_as_named_tool_call_arguments(
    family_engine: tuple[Engine, Tokenizer],
) -> None:
    engine, tok = family_engine
    fmt = call_format(tok.chat_template)
    assert fmt == "qwen3_xml"  # the demo templates write Qwen3 XML calls
    tools = []
    for schema in SCHEMAS:
        parameters = parse_schema(schema)
        assert isinstance(parameters, ObjectNode)
        tools.append(Tool(name="lookup", parameters=parameters, schema=schema))
    canvases = [call_canvas(tool, fmt, tok, OPTIONS) for tool in tools]
    opening = tok.decode(list(canvases[0].template.token_ids))
    assert opening.startswith("<tool_call>\n<function=lookup>\n<parameter=")
    assert _decode_and_judge(engine, tok, canvases, "Call the tool.") > 100


