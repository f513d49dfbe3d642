"""A decision over one long context prefills the context once for all its questions (issue 26).

``run_decision`` (the worker's path) queues an independent decision's sequences together; the
engine's prefix cache prefills their common prefix (the contract) once and copies it into every
question's slot, in chunks of the per-iteration budget like any prompt. Counted by the engine:
the prompt positions run through the model are the context's whole blocks once plus each
question's own tail, against the context once per question without the cache; the answers are
the same either way.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.decisions import DecisionQuestion, DecisionSpec, plan_decision, run_decision
from worker.engine.engine import Engine, EngineConfig
from worker.engine.stats import EngineStats
from worker.engine.types import SamplingParams
from worker.model.checkpoint import LoadedModel, load_checkpoint

QUESTIONS = 4
CHUNK = 256  # the per-iteration prefill budget: the context prefills in several chunks


@pytest.fixture(scope="module")
def tiny(demo_checkpoint: Path) -> LoadedModel:
    return load_checkpoint(demo_checkpoint)


Answers = list[tuple[str, str]]


def _decide(lm: LoadedModel, spec: DecisionSpec, prefix_bytes: int) -> tuple[Answers, EngineStats]:
    """The (id, choice) answers and the engine's counters of one decision on a fresh engine."""
    config = EngineConfig(max_batch=8, max_len=2048, prefill_chunk_tokens=CHUNK,
                          prefix_cache_bytes=prefix_bytes)
    engine = Engine(lm.model, config, mask_token_id=lm.config.mask_token_id, eos_token_ids=(),
                    default_block_size=lm.config.block_size)
    engine.start()
    try:
        outcome = run_decision(spec, tokenizer=lm.tokenizer, submit=engine.submit, request_id="long",
                               params=SamplingParams(), slot_class="standard", submit_many=engine.submit_many)
        assert outcome.result is not None, outcome.error_message
        return [(a["id"], a["choice"]) for a in outcome.result["answers"]], engine.stats()
    finally:
        engine.stop()


def test_questions_over_one_long_context_prefill_it_once(tiny: LoadedModel) -> None:
    context = " ".join(f"Clause {i}: the supplier shall deliver the goods within {i + 3} days of the order."
                       for i in range(30))  # ~1,450 tokens of the demo tokenizer
    questions = tuple(DecisionQuestion(id=f"q{i}", text=f"Is clause {i} breached?", choices=("yes", "no"))
                      for i in range(QUESTIONS))
    spec = DecisionSpec(mode="independent", context=context, questions=questions)
    plan = plan_decision(spec, tiny.tokenizer, request_id="p", params=SamplingParams(), rationale_tokens=0,
                         slot_class="standard")
    prompts = [r.prompt_ids for r in plan.requests]
    block = tiny.config.block_size or 1
    common = next(i for i, column in enumerate(zip(*prompts, strict=False)) if len(set(column)) > 1)
    shared = common // block * block  # the context's whole blocks: what the questions have in common
    tails = [len(p) // block * block - shared for p in prompts]  # each question's own whole blocks
    assert shared > 1000 > 4 * max(tails)  # a long context, short questions

    without, plain = _decide(tiny, spec, prefix_bytes=0)
    shared_result, stats = _decide(tiny, spec, prefix_bytes=1 << 30)
    assert shared_result == without  # the same answers (confidences agree to ~1e-5: prefix_cache.py)
    assert plain.prefill_positions == QUESTIONS * shared + sum(tails)  # the context once per question
    assert stats.prefill_positions == shared + sum(tails)  # the context once, then each question's tail
    assert stats.prefix_reused_positions == (QUESTIONS - 1) * shared
    assert stats.prefill_chunks >= shared // CHUNK  # in budget-sized chunks, never one context-long forward
