"""A generate job whose input carries ``response_schema`` (worker side): its text is the JSON of
a value valid against the schema, on the real tiny engine; a schema outside the subset is the
caller's input error, never a transient fault."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from scheduler.infra.settings import Settings
from scheduler.jobs.models import JobStatus
from scheduler.jobs.retry import InputJobError
from worker.engine.engine import Engine, EngineConfig
from worker.execution import run_generate
from worker.job_handler import EngineContext, JobSpec
from worker.model.checkpoint import load_checkpoint
from worker.model.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "party": {"type": "string", "maxLength": 8},
        "amount": {"type": "number", "minimum": 0},
        "renews": {"type": "boolean"},
        "notice_days": {"type": "integer", "minimum": 1, "maximum": 90},
        "tags": {"type": "array", "items": {"enum": ["nda", "msa", "sow"]}, "maxItems": 2},
    },
    "required": ["party", "amount", "renews"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def ctx(demo_checkpoint: Path) -> Iterator[EngineContext]:
    lm = load_checkpoint(demo_checkpoint)
    tok = Tokenizer.from_dir(demo_checkpoint)
    engine = Engine(
        lm.model, EngineConfig(max_batch=4, max_len=512), mask_token_id=tok.mask_token_id,
        eos_token_ids=lm.config.eos_token_ids, default_block_size=lm.config.block_size,
    )
    engine.start()
    yield EngineContext(
        submit=engine.submit, tokenizer=tok, settings=Settings(), deadline=None,
        cancel_event=threading.Event(), on_progress=lambda _p: None,
    )
    engine.stop()


def _job(schema: object) -> JobSpec:
    messages = [{"role": "user", "content": "Extract the contract fields."}]
    return JobSpec("j1", "generate", "standard", 1, {"messages": messages, "response_schema": schema},
                   {"temperature": 0.8, "seed": 3})


def test_generate_with_a_response_schema_returns_valid_json(ctx: EngineContext) -> None:
    outcome = run_generate(_job(SCHEMA), ctx)
    assert outcome.status is JobStatus.SUCCEEDED and outcome.result is not None
    value = json.loads(outcome.result["text"])
    jsonschema.validate(value, SCHEMA)
    assert value == outcome.result["data"]
    assert 0.0 < outcome.result["confidence"]["/renews"] <= 1.0
    # the canvas decoded to its end: a complete answer (OpenAI clients read "length" as cut off)
    assert outcome.finish_reason == outcome.result["finish_reason"] == "eos"


def test_an_unsupported_keyword_is_an_input_error(ctx: EngineContext) -> None:
    with pytest.raises(InputJobError, match="pattern"):
        run_generate(_job({"type": "string", "pattern": "x"}), ctx)
