"""bench.sampler's full-recompute reference: batching its rows changes no token, it decodes what
``worker/engine/reference_decode.py`` decodes for each row, and what the cached engine decodes (so
the speed-up it reports compares equal work)."""

from __future__ import annotations

from pathlib import Path

from bench.sampler import _engine, _prompt, reference_decode
from worker.engine.reference_decode import reference_decode as readable_decode
from worker.engine.types import GenerationRequest, SamplingParams
from worker.model.checkpoint import load_checkpoint


def test_batched_reference_equals_row_by_row_and_the_engine(demo_checkpoint: Path) -> None:
    lm = load_checkpoint(demo_checkpoint)
    cfg = lm.config
    block, steps, new = cfg.block_size or 4, 2, 13
    prompts = [_prompt(i, 6, cfg.vocab_size, cfg.mask_token_id) for i in range(3)]
    batched, _, _, passes = reference_decode(lm, prompts, new, block, steps)
    rows = [reference_decode(lm, [p], new, block, steps)[0][0] for p in prompts]
    assert batched == rows
    assert passes > 0 and len(batched) == len(prompts) and all(len(t) == new for t in batched)
    # the batched copy is the readable contract loop's greedy static case (no EOS: the bench's rows
    # run to their length)
    params = SamplingParams(max_new_tokens=new, block_size=block, steps_per_block=steps, strategy="static")
    readable = [readable_decode(lm.model, p, params, mask_token_id=cfg.mask_token_id, eos_token_ids=())
                for p in prompts]  # fmt: skip
    assert [r.token_ids for r in readable] == batched

    engine = _engine(lm, len(prompts), 6 + new + block)
    try:
        params = SamplingParams(
            max_new_tokens=new, block_size=block, steps_per_block=steps, strategy="static"
        )
        futures = [engine.submit(GenerationRequest(f"r{i}", p, params)) for i, p in enumerate(prompts)]
        assert [f.result().token_ids for f in futures] == batched
    finally:
        engine.stop()
