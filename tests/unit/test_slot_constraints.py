"""Restricted slots that must agree (``SlotConstraint``): the combination choice against a brute
force, and the sampler's bookkeeping in one pass and block by block."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from worker.engine.types import GenerationRequest, InfillSlot, InfillTemplate, SamplingParams, SlotConstraint
from worker.sampler.constraints import agreeing, candidates_left, choose_combination
from worker.sampler.layout import RequestError, build_layout
from worker.sampler.sequence import SequenceState

GATE = ((0, 0), (0, 1), (1, 2))  # yes/no, then yes/no/n.a.: "no" goes with "n.a." only


def test_the_choice_is_the_best_allowed_total_and_probabilities_are_its_marginals() -> None:
    """Against a brute force over the scored members' part of each allowed combination."""
    rng = random.Random(5)
    for _ in range(200):
        sizes = [rng.randint(2, 4) for _ in range(rng.randint(2, 3))]
        every = list(itertools.product(*[range(n) for n in sizes]))
        combos = rng.sample(every, rng.randint(1, min(6, len(every))))
        scores = {p: {c: rng.uniform(-6, 0) for c in range(n)}
                  for p, n in enumerate(sizes) if p == 0 or rng.random() < 0.7}  # fmt: skip
        members = sorted(scores)
        totals = {tuple(k[p] for p in members): sum(scores[p][k[p]] for p in members) for k in combos}
        best = max(totals, key=totals.__getitem__)
        z = sum(math.exp(t) for t in totals.values())
        chosen = choose_combination(combos, scores)
        assert sorted(chosen) == members
        for k, p in enumerate(members):
            candidate, prob = chosen[p]
            assert candidate == best[k]
            assert prob == pytest.approx(sum(math.exp(t) for c, t in totals.items() if c[k] == candidate) / z)


def test_an_unscored_partner_does_not_favour_the_value_of_more_combinations() -> None:
    """Gate rule, only the first slot scored (its partner's last block comes later): "yes" is
    in two combinations and "no" in one, yet the choice follows the first slot's own 0.3 / 0.7."""
    scores = {0: {0: math.log(0.3), 1: math.log(0.7)}}
    assert choose_combination(GATE, scores)[0] == (1, pytest.approx(0.7))
    assert choose_combination(GATE, scores, u=0.29, temperature=1.0)[0][0] == 0
    assert choose_combination(GATE, scores, u=0.31, temperature=1.0)[0][0] == 1


def test_sampling_draws_combinations_by_their_totals() -> None:
    combos = [(0, 0), (1, 1)]
    scores = {0: {0: math.log(0.25), 1: math.log(0.75)}, 1: {0: 0.0, 1: 0.0}}
    assert choose_combination(combos, scores, u=0.2, temperature=1.0) == {0: (0, 0.25), 1: (0, 0.25)}
    assert choose_combination(combos, scores, u=0.3, temperature=1.0)[1][0] == 1


def test_agreeing_and_candidates_left() -> None:
    assert agreeing(GATE, {0: 1}) == [(1, 2)]
    assert candidates_left(agreeing(GATE, {0: 0}), 1, [0, 1, 2]) == [0, 1]
    with pytest.raises(ValueError, match="no allowed combination"):
        choose_combination([], {})


def _gate_state(one_pass: bool) -> SequenceState:
    """Prompt 4 tokens; template: slot 0 (yes/no) at offsets 1-2 (block 1), slot 1 (yes/no/n.a.)
    at offsets 6-7 (block 2), tied by the gate rule."""
    template = InfillTemplate(
        token_ids=tuple(range(50, 60)),
        slots=(InfillSlot(1, 2, allowed_sequences=((11, 12), (13, 14))),
               InfillSlot(6, 2, allowed_sequences=((11, 12), (13, 14), (15, 16)))),
        pad_id=9, one_pass=one_pass, constraints=(SlotConstraint((0, 1), GATE),),
    )  # fmt: skip
    request = GenerationRequest("r", [1, 2, 3, 4], SamplingParams(max_new_tokens=1, steps_per_block=1),
                                template=template)  # fmt: skip
    return SequenceState.start(request, build_layout(request, 4, 128, 4096), block_size=4, mask_token_id=0,
                               eos_token_ids=frozenset())  # fmt: skip


def test_in_one_pass_the_slots_are_chosen_together() -> None:
    """Alone, slot 0 would say "no" (0.6) and slot 1 "yes" (0.9): a broken rule. Together the
    best allowed combination is ("yes", "yes")."""
    state = _gate_state(one_pass=True)
    p = state.pass_input()
    assert [g.scored for g in p.groups] == [True, True]
    p.groups[0].scores = [math.log(0.4), math.log(0.6)]
    p.groups[1].scores = [math.log(0.9), math.log(0.05), math.log(0.05)]
    chosen = [0] * p.block_len
    state.apply_pass(chosen, p.masked, [(1, 0.6), (0, 0.9)])  # the runner's lone picks
    assert state.finished
    assert [c.index for c in state.slot_choices()] == [0, 0]
    assert state.output_ids()[1:3] == [11, 12] and state.output_ids()[6:8] == [11, 12]


def test_block_by_block_a_decided_slot_narrows_the_later_ones() -> None:
    state = _gate_state(one_pass=False)
    p = state.pass_input()  # block 1: slot 0 alone
    assert len(p.groups) == 1
    p.groups[0].scores = [math.log(0.3), math.log(0.7)]
    state.apply_pass([0, 0, 13, 14], [False, True, True, False], [(1, 0.7)])  # "no"
    p = state.pass_input()  # block 2: slot 1 may only be "n.a."
    assert p.groups[0].candidates == [(15, 16)] and p.groups[0].candidate_ids == [2]
    p.groups[0].scores = [math.log(0.01)]
    state.apply_pass([0, 0, 15, 16], [False, False, True, True], [(0, 1.0)])
    assert [c.index for c in state.slot_choices()] == [1, 2]


@pytest.mark.parametrize(("constraints", "message"), [
    ((SlotConstraint((0,), ((0,),)),), "two slots"),
    ((SlotConstraint((0, 5), ((0, 0),)),), "not a slot"),
    ((SlotConstraint((0, 1), ((0, 3),)),), "does not fit"),
    ((SlotConstraint((0, 1), ((0, 0, 0),)),), "does not fit"),
    ((SlotConstraint((0, 1), ((0, 0),)), SlotConstraint((1, 0), ((0, 0),))), "in another constraint"),
])  # fmt: skip
def test_a_constraint_that_does_not_fit_its_slots_is_refused(
    constraints: tuple[SlotConstraint, ...], message: str
) -> None:
    template = InfillTemplate(tuple(range(50, 60)), (InfillSlot(1, 2, allowed_sequences=((11, 12), (13, 14))),
                              InfillSlot(6, 2, allowed_sequences=((11, 12), (13, 14), (15, 16)))),
                              pad_id=9, constraints=constraints)  # fmt: skip
    with pytest.raises(RequestError, match=message):
        build_layout(GenerationRequest("r", [1], SamplingParams(), template=template), 4, 128, 4096)
