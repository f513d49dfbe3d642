"""The ``extract`` kind on the worker side, on the real tiny engines of both families (Clover and
SDAR): the value validates against the schema (judged by ``jsonschema``), jobs over one document
share its prefill through the engine's prefix cache, and the router's canvas estimate is never
below the real canvas."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from scheduler.infra.settings import Settings
from scheduler.jobs import canvas_size
from scheduler.jobs.models import JobStatus
from scheduler.jobs.retry import InputJobError
from scheduler.jobs.schema_subset import parse_schema
from worker.engine.engine import Engine, EngineConfig
from worker.execution import run_kind
from worker.extract_job import extract_prompt_ids
from worker.job_handler import EngineContext, JobSpec
from worker.model.checkpoint import load_checkpoint
from worker.model.tokenizer import Tokenizer
from worker.structured.canvas import CanvasOptions, compile_canvas

DOCUMENT = ("MASTER SERVICES AGREEMENT. This agreement is made between Acme Corp (the Seller) and Bolt Ltd "
            "(the Buyer). The Buyer pays 1200 dollars per month. Either party may end it with 30 days' "
            "notice. New York law governs. Signed on 2024-03-01.")
PARTIES = {"type": "object", "properties": {"seller": {"type": "string", "maxLength": 12},
                                            "buyer": {"type": "string", "maxLength": 12}},
           "required": ["seller", "buyer"], "additionalProperties": False}
TERMS = {"type": "object", "properties": {
    "monthly_fee": {"type": "number", "minimum": 0},
    "notice_days": {"type": "integer", "minimum": 1, "maximum": 90},
    "law": {"enum": ["NY", "DE", "CA"]},
    "renews": {"type": "boolean"},
    "signed": {"type": "string", "format": "date"},
    "tags": {"type": "array", "items": {"enum": ["msa", "nda"]}, "maxItems": 2},
}, "required": ["monthly_fee", "law", "renews"]}
ANY_OBJECT = {"type": "object"}


@pytest.fixture(scope="module", params=["clover", "sdar"])
def ctx(request: pytest.FixtureRequest) -> Iterator[EngineContext]:
    fixture = "demo_checkpoint" if request.param == "clover" else "sdar_checkpoint"
    path: Path = request.getfixturevalue(fixture)
    lm = load_checkpoint(path)
    tok = Tokenizer.from_dir(path)
    engine = Engine(
        lm.model, EngineConfig(max_batch=4, max_len=768, prefix_cache_bytes=64 << 20),
        mask_token_id=tok.mask_token_id, eos_token_ids=lm.config.eos_token_ids,
        default_block_size=lm.config.block_size,
    )
    engine.start()
    context = EngineContext(submit=engine.submit, tokenizer=tok, settings=Settings(), deadline=None,
                            cancel_event=threading.Event(), on_progress=lambda _p: None,
                            default_block_size=lm.config.block_size)
    context.engine = engine  # type: ignore[attr-defined]  # the tests read its prefix-cache counters
    yield context
    engine.stop()


def _job(schema: Any, *, context: str = DOCUMENT, seed: int = 3, **input_fields: Any) -> JobSpec:
    job_input = {"context": context, "schema": schema, **input_fields}
    return JobSpec(f"x{seed}", "extract", "standard", 1, job_input, {"temperature": 0.8, "seed": seed})


@pytest.mark.parametrize("schema", [PARTIES, TERMS, ANY_OBJECT], ids=["strings", "choices", "json_object"])
def test_the_value_validates_against_the_schema(ctx: EngineContext, schema: dict[str, Any]) -> None:
    outcome = run_kind(_job(schema, instructions="Find the fields."), ctx)
    assert outcome.status is JobStatus.SUCCEEDED and outcome.result is not None
    data = outcome.result["data"]
    jsonschema.validate(data, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    assert json.loads(outcome.result["text"]) == data
    assert outcome.finish_reason == outcome.result["finish_reason"] == "eos"  # complete, not cut off
    if schema is TERMS:  # choice fields carry their probability, by JSON pointer
        assert set(outcome.result["confidence"]) >= {"/law", "/renews"}
        assert all(0.0 < p <= 1.0 for p in outcome.result["confidence"].values())


def test_a_canvas_whose_step_budget_ran_out_says_budget_and_is_still_valid(ctx: EngineContext) -> None:
    job = _job(TERMS)
    job = JobSpec(job.job_id, job.kind, job.queue, job.attempt, job.input, {**job.params, "step_budget": 1})
    outcome = run_kind(job, ctx)
    assert outcome.result is not None
    assert outcome.finish_reason == outcome.result["finish_reason"] == "budget"
    jsonschema.validate(outcome.result["data"], TERMS)  # the budget's last pass commits the rest


def test_jobs_over_one_document_share_its_prefill(ctx: EngineContext) -> None:
    engine: Engine = ctx.engine  # type: ignore[attr-defined]
    document = DOCUMENT + " Schedule A lists the widgets and their prices."  # a document new to the cache
    schemas = [PARTIES, TERMS, {"type": "object", "properties": {"fee": {"type": "integer"}}}]
    prompts = [extract_prompt_ids(_job(s, context=document), ctx.tokenizer) for s in schemas]
    shared = next(i for i, (a, b) in enumerate(zip(prompts[1], prompts[2], strict=False)) if a != b)
    doc_tokens = len(ctx.tokenizer.encode(document))
    assert shared >= doc_tokens  # the document (and what precedes it) is the common prefix
    before = engine.stats()
    for seed, schema in enumerate(schemas):  # one after another: a burst in time, not one round
        assert run_kind(_job(schema, context=document, seed=seed), ctx).status is JobStatus.SUCCEEDED
    after = engine.stats()
    # the first is remembered, the second stores the shared blocks, the third starts from them
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 1
    block = ctx.default_block_size or 1
    reused = after.prefix_reused_positions - before.prefix_reused_positions
    assert reused >= (doc_tokens // block - 1) * block


def test_thinking_is_off_and_the_template_renders_the_document_first(ctx: EngineContext) -> None:
    ids = extract_prompt_ids(_job(PARTIES), ctx.tokenizer)
    text = ctx.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.index(DOCUMENT) < text.index("seller")
    assert "<think>\n\n</think>" in text or "<think>" not in text  # closed (off) or no thinking markers


def test_bad_input_is_the_callers_error(ctx: EngineContext) -> None:
    with pytest.raises(InputJobError, match="pattern"):
        run_kind(_job({"type": "string", "pattern": "x"}), ctx)
    with pytest.raises(InputJobError, match="context"):
        run_kind(_job(PARTIES, context=""), ctx)


def test_the_routers_canvas_estimate_matches_the_canvas(ctx: EngineContext) -> None:
    room = CanvasOptions()
    mirrored = (canvas_size.STRING_TOKENS, canvas_size.ARRAY_ITEMS, canvas_size.FREE_PAIRS,
                canvas_size.INTEGER_DIGITS)
    assert mirrored == (room.string_tokens, room.array_items, room.free_pairs, room.integer_digits)
    wide = {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number", "maximum": 5e6},
        "any": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}}
    for schema in (PARTIES, TERMS, ANY_OBJECT, wide, {"type": "array", "items": TERMS, "minItems": 1}):
        node = parse_schema(schema)
        real = len(compile_canvas(node, ctx.tokenizer).template.token_ids)  # type: ignore[arg-type]
        assert real <= canvas_size.estimate_canvas_tokens(node) <= 3 * real + 16, schema
