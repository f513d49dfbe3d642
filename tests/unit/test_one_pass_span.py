"""A ``one_pass`` template: every restricted slot decided in one pass over one span of blocks
(``worker/sampler/sequence.py``), against the block-by-block decode of the same template."""

from __future__ import annotations

import pytest

from worker.engine.types import FinishReason, GenerationRequest, InfillSlot, InfillTemplate, SamplingParams
from worker.sampler.layout import RequestError, build_layout
from worker.sampler.sequence import SequenceState

BLOCK = 4
MASK = 0
PAD = 9


def _template(one_pass: bool, free_slot: bool = False) -> InfillTemplate:
    """14 fixed tokens (ids 50..63) with two restricted slots: template offsets 3-4 (two
    candidates) and 10-11 (three); after a 5-token prompt those are absolute 8-9 (block 2) and
    15-16 (blocks 3 and 4: the second slot crosses a block boundary)."""
    slots = [
        InfillSlot(start=3, length=2, allowed_sequences=((11, 12), (13, PAD))),
        InfillSlot(start=10, length=2, allowed_sequences=((21, 22), (23, 24), (25, PAD))),
    ]
    if free_slot:
        slots.append(InfillSlot(start=6, length=2))
    return InfillTemplate(token_ids=tuple(range(50, 64)), slots=tuple(slots), pad_id=PAD, one_pass=one_pass)


def _state(one_pass: bool, budget: int | None = None) -> SequenceState:
    params = SamplingParams(max_new_tokens=1, steps_per_block=4, strategy="static", step_budget=budget)
    request = GenerationRequest("r", [1, 2, 3, 4, 5], params, template=_template(one_pass))
    layout = build_layout(request, BLOCK, 128, 4096)
    return SequenceState.start(request, layout, block_size=BLOCK, mask_token_id=MASK,
                               eos_token_ids=frozenset())  # fmt: skip


def test_the_span_runs_from_the_first_slots_block_to_the_last_slots_and_is_one_pass() -> None:
    state = _state(one_pass=True)
    assert state.span == (2, 4)
    p = state.pass_input()
    # the committed prefix runs to the span (prompt and fixed tokens 5..7); the span to the
    # template's end (position 18), 11 positions
    assert (p.start_pos, p.commit_len, p.block_len) == (0, 8, 11)
    masked_at = [8 + o for o, m in enumerate(p.masked) if m]
    assert masked_at == [8, 9, 15, 16]  # every slot position, nothing else
    assert p.quota == 4  # all of them in this pass
    assert [(g.final, g.offsets, g.prior) for g in p.groups] == [(True, [0, 1], None), (True, [7, 8], None)]
    assert p.tokens[8:] == [MASK, MASK, 55, 56, 57, 58, 59, MASK, MASK, 62, 63]

    chosen = [0] * 11
    chosen[0:2], chosen[7:9] = [13, PAD], [23, 24]
    done = state.apply_pass(chosen, p.masked, [(1, 0.8), (1, 0.6)])
    assert done and state.finished and state.finish_reason is FinishReason.LENGTH
    assert state.steps_used == 1 and state.blocks_done == 4  # blocks 1 (fixed), 2-4 (the span)
    out = state.output_ids()
    assert out[3:5] == [13, PAD] and out[10:12] == [23, 24] and len(out) == 14
    assert [(c.index, c.confidence) for c in state.slot_choices()] == [(1, 0.8), (1, 0.6)]


def test_block_by_block_the_same_template_takes_a_pass_per_slot_block() -> None:
    """The contrast: without one_pass the second slot is deferred in block 3 and decided in 4."""
    state = _state(one_pass=False)
    assert state.span is None
    p = state.pass_input()
    assert (p.commit_len, p.block_len, p.quota) == (8, 4, 1)  # block 2 alone, steps_per_block 4
    assert state.pass_input().groups[0].final


def test_a_step_budget_of_one_pass_is_enough_for_one_pass_and_not_for_blocks() -> None:
    one = _state(one_pass=True, budget=1)
    p = one.pass_input()
    one.apply_pass([13] * 11, p.masked, [(0, 1.0), (0, 1.0)])
    assert one.finish_reason is FinishReason.LENGTH

    blocks = _state(one_pass=False, budget=1)
    p = blocks.pass_input()
    blocks.apply_pass([11, 12, 0, 0], [True, True, False, False], [(0, 1.0)])
    assert blocks.finish_reason is FinishReason.BUDGET


def test_fixed_blocks_after_the_span_complete_without_a_pass() -> None:
    """The span ends at the last slot's block (as the training pass does); the template's fixed
    tail after it is committed already and costs no pass."""
    template = _template(one_pass=True)
    longer = InfillTemplate(token_ids=(*template.token_ids, 64, 65, 66, 67, 68, 69), slots=template.slots,
                            pad_id=PAD, one_pass=True)  # fmt: skip
    request = GenerationRequest("r", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=1, steps_per_block=4),
                                template=longer)  # fmt: skip
    state = SequenceState.start(request, build_layout(request, BLOCK, 128, 4096), block_size=BLOCK,
                                mask_token_id=MASK, eos_token_ids=frozenset())  # fmt: skip
    p = state.pass_input()
    assert p.block_len == 12  # positions 8..19: blocks 2-4, not the tail (positions 20..24, blocks 5-6)
    state.apply_pass([0] * 12, p.masked, [(0, 1.0), (2, 1.0)])
    assert state.finish_reason is FinishReason.LENGTH and state.steps_used == 1 and state.blocks_done == 6
    assert state.output_ids()[-6:] == [64, 65, 66, 67, 68, 69]


def test_a_sampled_span_draws_a_uniform_per_position_of_the_span() -> None:
    params = SamplingParams(max_new_tokens=1, steps_per_block=4, temperature=0.8, seed=3)
    request = GenerationRequest("r", [1, 2, 3, 4, 5], params, template=_template(one_pass=True))
    state = SequenceState.start(request, build_layout(request, BLOCK, 128, 4096), block_size=BLOCK,
                                mask_token_id=MASK, eos_token_ids=frozenset())  # fmt: skip
    p = state.pass_input()
    assert p.uniforms is not None and len(p.uniforms) == p.block_len == 11


def test_one_pass_refuses_a_slot_of_free_text() -> None:
    request = GenerationRequest("r", [1, 2, 3], SamplingParams(max_new_tokens=1),
                                template=_template(one_pass=True, free_slot=True))  # fmt: skip
    with pytest.raises(RequestError, match="one_pass"):
        build_layout(request, BLOCK, 128, 4096)
