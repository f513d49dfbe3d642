"""The schema subset's errors, the canvas layout of each slot kind, and the pad-tail rule."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler.jobs.schema_subset import (
    EnumNode,
    IntegerNode,
    ParseOptions,
    SchemaError,
    SchemaErrorCode,
    parse_schema,
)
from worker.engine.engine import Engine, EngineConfig
from worker.engine.types import GenerationRequest, InfillSlot, InfillTemplate, SamplingParams
from worker.model.checkpoint import LoadedModel, load_checkpoint
from worker.model.tokenizer import Tokenizer
from worker.sampler.pad_tail import content_required_before, forced_pads
from worker.structured.canvas import CanvasOptions, compile_canvas

P = 0  # the pad in the pure-rule tests


def test_forced_pads_fill_everything_after_the_first_pad() -> None:
    assert forced_pads([5, None, P, None, 7], P) == [3, 4]  # 7 was chosen the same pass: the pad wins
    assert forced_pads([5, None, None], P) == []
    assert forced_pads([P, P], P) == []


def test_content_is_required_before_the_last_content_token_and_the_minimum() -> None:
    assert content_required_before([None, None, 9, None], P, 0) == 2
    assert content_required_before([None, None, None], P, 1) == 1
    assert content_required_before([None, 3, P], P, 0) == 1


@pytest.mark.parametrize(
    ("schema", "code", "keyword"),
    [
        ({"type": "string", "pattern": "a+"}, SchemaErrorCode.UNSUPPORTED_KEYWORD, "pattern"),
        (
            {"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}},
            SchemaErrorCode.UNSUPPORTED_KEYWORD,
            "$ref",
        ),
        ({"type": "string", "format": "email"}, SchemaErrorCode.UNSUPPORTED_KEYWORD, "format"),
        (
            {"type": "object", "additionalProperties": {"type": "string"}},
            SchemaErrorCode.UNSUPPORTED_KEYWORD,
            "additionalProperties",
        ),
        ({"type": "strin"}, SchemaErrorCode.INVALID_SCHEMA, None),
        ({"type": "integer", "minimum": 5, "maximum": 4}, SchemaErrorCode.INVALID_SCHEMA, None),
        ({"type": "string", "minLength": 5, "maxLength": 2}, SchemaErrorCode.INVALID_SCHEMA, None),
        ({"enum": [1, 2], "type": "string"}, SchemaErrorCode.INVALID_SCHEMA, None),
    ],
)
def test_schemas_outside_the_subset_are_refused_naming_the_keyword(
    schema: dict[str, object], code: SchemaErrorCode, keyword: str | None
) -> None:
    with pytest.raises(SchemaError) as info:
        parse_schema(schema)
    assert info.value.code is code
    assert info.value.keyword == keyword


def test_limits_on_size_and_nesting() -> None:
    deep: dict[str, object] = {"type": "string"}
    for _ in range(5):
        deep = {"type": "array", "items": deep}
    with pytest.raises(SchemaError) as info:
        parse_schema(deep, ParseOptions(max_depth=3))
    assert info.value.code is SchemaErrorCode.SCHEMA_TOO_LARGE
    with pytest.raises(SchemaError) as info:
        parse_schema({"type": "string", "description": "x" * 100}, ParseOptions(max_schema_bytes=64))
    assert info.value.code is SchemaErrorCode.SCHEMA_TOO_LARGE


def test_small_integer_ranges_booleans_and_anyof_of_choices_become_one_choice() -> None:
    assert parse_schema({"type": "integer", "minimum": 1, "exclusiveMaximum": 4}) == EnumNode((1, 2, 3))
    assert parse_schema({"type": "integer", "minimum": 0}) == IntegerNode(0, None)
    node = parse_schema({"anyOf": [{"type": "boolean"}, {"type": "null"}, {"const": 3}]})
    assert node == EnumNode((True, False, None, 3))


def tok_mask(lm: LoadedModel) -> int:
    assert lm.config.mask_token_id is not None
    return lm.config.mask_token_id


@pytest.fixture(scope="module")
def clover(demo_checkpoint: Path) -> Iterator[tuple[Engine, Tokenizer]]:
    lm = load_checkpoint(demo_checkpoint)
    engine = Engine(
        lm.model,
        EngineConfig(max_batch=16, max_len=512),
        mask_token_id=tok_mask(lm),
        eos_token_ids=lm.config.eos_token_ids,
        default_block_size=lm.config.block_size,
    )
    engine.start()
    yield engine, Tokenizer.from_dir(demo_checkpoint)
    engine.stop()


def test_canvas_fixes_the_structure_and_reads_back_a_valid_value(clover: tuple[Engine, Tokenizer]) -> None:
    engine, tok = clover
    schema = {
        "type": "object",
        "properties": {
            "party": {"type": "string", "maxLength": 6},
            "signed": {"type": "string", "format": "date"},
            "kind": {"enum": ["nda", "msa"]},
        },
        "required": ["party", "signed", "kind"],
        "additionalProperties": False,
    }
    canvas = compile_canvas(parse_schema(schema), tok, CanvasOptions(string_tokens=4))
    text = tok.decode(list(canvas.template.token_ids))
    assert text.startswith('{"party": "') and '"kind": ' in text and text.endswith("}")
    result = engine.submit(
        GenerationRequest("c", tok.encode("x"), SamplingParams(), template=canvas.template)
    ).result(60)
    out = canvas.read(result.slot_choices, tok)
    assert set(out.value) == {"party", "signed", "kind"} and len(out.value["party"]) <= 6
    assert out.value["kind"] in ("nda", "msa") and 0.5 <= out.confidence["/kind"] <= 1.0


def test_pad_tail_rule_holds_for_any_commit_order(clover: tuple[Engine, Tokenizer]) -> None:
    """A pad-tail slot that crosses blocks, sampled with many seeds and block sizes: always
    content* pad* with at least min_tokens content tokens, and pads were actually taken."""
    engine, tok = clover
    content = tuple(range(40, 60))
    pad = tok.pad_token_id
    rng = random.Random(7)
    saw_pads = saw_content_after_start = 0
    for seed in range(40):
        slot = InfillSlot(2, 9, allowed_token_ids=content, pad_tail=True, min_tokens=2)
        template = InfillTemplate((70, 71, *([pad] * 9), 72), (slot,), pad_id=pad)
        params = SamplingParams(
            temperature=1.5, seed=seed, block_size=rng.choice([2, 4, 8]), steps_per_block=rng.randint(1, 4)
        )
        result = engine.submit(
            GenerationRequest(f"t{seed}", tok.encode("a"), params, template=template)
        ).result(60)
        ids = result.slot_choices[0].token_ids
        n = sum(1 for t in ids if t != pad)
        assert all(t in content for t in ids[:n]) and all(t == pad for t in ids[n:]) and n >= 2
        saw_pads += n < 9
        saw_content_after_start += n > 2
    assert saw_pads and saw_content_after_start
