"""Pure decoding rules on fake logits: quotas, step budgets, selection, commit rules, ties."""

from __future__ import annotations

import pytest
import torch

from worker.engine.types import FinishReason, GenerationRequest, SamplingParams
from worker.sampler.commit import choose_commits, expand_to_groups, rank_by_confidence
from worker.sampler.layout import build_layout
from worker.sampler.schedule import plan_block_steps, step_quotas
from worker.sampler.selection import RowSampling, filter_logits, select_tokens
from worker.sampler.sequence import SequenceState


def _params(r: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> RowSampling:
    return RowSampling(
        temperature=torch.full((r,), temperature),
        top_k=torch.full((r,), top_k, dtype=torch.long),
        top_p=torch.full((r,), top_p),
    )


@pytest.mark.parametrize(
    ("masked", "steps", "expected"),
    [
        (8, 4, [2, 2, 2, 2]),
        (7, 4, [2, 2, 2, 1]),
        (5, 4, [2, 1, 1, 1]),
        (3, 4, [1, 1, 1]),  # zero-quota steps skipped
        (0, 4, []),
        (4, 1, [4]),
        (10, 3, [4, 3, 3]),
    ],
)
def test_quotas_follow_the_contract(masked: int, steps: int, expected: list[int]) -> None:
    quotas = step_quotas(masked, steps)
    assert quotas == expected
    assert sum(quotas) == masked
    assert len(quotas) <= steps


def test_plan_keeps_full_steps_when_affordable() -> None:
    assert plan_block_steps(4, 3, None) == 4
    assert plan_block_steps(4, 3, 12) == 4
    assert plan_block_steps(4, 3, 100) == 4


def test_plan_lowers_steps_when_tight_never_below_one() -> None:
    assert plan_block_steps(4, 3, 11) == 3
    assert plan_block_steps(4, 3, 3) == 1
    assert plan_block_steps(4, 3, 2) == 1  # cannot afford every block: still one pass
    assert plan_block_steps(4, 3, 0) == 0  # nothing left


def test_replanned_schedule_never_exceeds_budget() -> None:
    for blocks in range(1, 9):
        for steps in range(1, 6):
            for budget in range(0, blocks * steps + 3):
                used, left = 0, blocks
                while left:
                    s = plan_block_steps(steps, left, budget - used)
                    if s == 0:
                        break
                    used += s
                    left -= 1
                assert used <= budget
                if budget >= blocks:  # affordable: every block decoded
                    assert left == 0
                if budget >= blocks * steps:
                    assert used == blocks * steps


def test_greedy_picks_argmax_and_its_softmax_probability() -> None:
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 3.0]]])  # [1, 2, 3]
    tokens, conf = select_tokens(logits, _params(1), None)
    assert tokens.tolist() == [[1, 0]]  # argmax ties -> first index
    probs = torch.softmax(logits, dim=-1)
    assert conf[0, 0].item() == pytest.approx(probs[0, 0, 1].item())
    assert conf[0, 1].item() == pytest.approx(probs[0, 1, 0].item())


def test_top_k_and_top_p_filter_before_the_draw() -> None:
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))  # [1, 1, 4]
    kept_k = torch.isfinite(filter_logits(logits, _params(1, 1.0, top_k=2)))
    assert kept_k.tolist() == [[[True, True, False, False]]]
    kept_p = torch.isfinite(filter_logits(logits, _params(1, 1.0, top_p=0.7)))
    assert kept_p.tolist() == [[[True, True, False, False]]]  # 0.5 < 0.7, then 0.8 >= 0.7
    kept_p = torch.isfinite(filter_logits(logits, _params(1, 1.0, top_p=0.4)))
    assert kept_p.tolist() == [[[True, False, False, False]]]  # the best token always stays
    # sampled tokens only ever come from the kept set; confidence renormalised over it
    u = torch.rand(1, 64, generator=torch.Generator().manual_seed(0))
    tokens, conf = select_tokens(logits.expand(1, 64, 4), _params(1, 1.0, top_k=2), u)
    assert set(tokens.flatten().tolist()) <= {0, 1}
    assert set(tokens.flatten().tolist()) == {0, 1}
    assert torch.allclose(conf[tokens == 0], torch.tensor(0.5 / 0.8))


def test_seeded_draw_follows_the_uniforms() -> None:
    probs = torch.tensor([[[0.25, 0.25, 0.5]]])
    logits = probs.log().expand(1, 3, 3)
    u = torch.tensor([[0.1, 0.3, 0.9]])
    tokens, _ = select_tokens(logits, _params(1, 1.0), u)
    assert tokens.tolist() == [[0, 1, 2]]


def test_temperature_sharpens() -> None:
    logits = torch.tensor([[[1.0, 0.0]]])
    _, hot = select_tokens(logits, _params(1, 2.0), torch.zeros(1, 1))
    _, cold = select_tokens(logits, _params(1, 0.5), torch.zeros(1, 1))
    assert cold.item() > hot.item()


def test_static_commits_quota_most_confident_ties_to_lower_position() -> None:
    conf = torch.tensor([[0.5, 0.9, 0.5, 0.5, 0.9]])
    masked = torch.tensor([[True, True, True, True, False]])
    chosen = choose_commits(conf, masked, torch.tensor([2]), torch.tensor([0.0]), torch.tensor([False]))
    assert chosen.tolist() == [[True, True, False, False, False]]  # 0.9 at 1, then tie 0.5 -> position 0
    assert rank_by_confidence(conf, masked).tolist() == [[1, 0, 2, 3, 4]]


def test_dynamic_commits_all_above_threshold_or_falls_back() -> None:
    conf = torch.tensor([[0.95, 0.2, 0.97, 0.96], [0.95, 0.2, 0.1, 0.3]])
    masked = torch.ones(2, 4, dtype=torch.bool)
    chosen = choose_commits(
        conf, masked, torch.tensor([2, 2]), torch.tensor([0.9, 0.9]), torch.tensor([True, True])
    )
    assert chosen[0].tolist() == [True, False, True, True]  # three above > quota 2: all of them
    assert chosen[1].tolist() == [True, False, False, True]  # one above < quota: top-2 instead


def test_dynamic_threshold_is_strict() -> None:
    conf = torch.tensor([[0.5, 0.5, 0.4]])
    masked = torch.ones(1, 3, dtype=torch.bool)
    chosen = choose_commits(conf, masked, torch.tensor([1]), torch.tensor([0.5]), torch.tensor([True]))
    assert chosen.tolist() == [[True, False, False]]


def test_quota_counts_only_masked_positions() -> None:
    conf = torch.tensor([[0.99, 0.1, 0.2]])
    masked = torch.tensor([[False, True, True]])
    chosen = choose_commits(conf, masked, torch.tensor([1]), torch.tensor([0.0]), torch.tensor([False]))
    assert chosen.tolist() == [[False, False, True]]


def test_groups_commit_as_a_unit() -> None:
    chosen = torch.tensor([[False, True, False, False]])
    groups = torch.tensor([[0, 0, -1, 1]])
    assert expand_to_groups(chosen, groups, 2).tolist() == [[True, True, False, False]]


def _plain_state(prompt_len: int, new: int, eos: int = 99) -> SequenceState:
    params = SamplingParams(max_new_tokens=new, steps_per_block=4, strategy="static")
    request = GenerationRequest("r", list(range(1, prompt_len + 1)), params)
    layout = build_layout(request, 4, 128, 4096)
    return SequenceState.start(request, layout, block_size=4, mask_token_id=0, eos_token_ids=frozenset({eos}))


def test_a_block_ends_once_its_output_is_settled_by_an_eos() -> None:
    """An EOS with every output position before it committed ends the request at that pass:
    the masks after it cannot change the output (fewer passes, the same tokens)."""
    state = _plain_state(prompt_len=4, new=8)  # region: blocks 1 and 2, four masks each
    state.apply_pass([7, 8, 9, 10], [True, False, False, False])  # block 1: one token per pass
    state.apply_pass([7, 8, 9, 10], [False, True, False, False])
    state.apply_pass([7, 8, 9, 10], [False, False, True, False])
    state.apply_pass([7, 8, 9, 10], [False, False, False, True])
    assert not state.finished and state.block_index == 2
    state.apply_pass([5, 99, 6, 6], [False, True, False, False])  # an EOS, a mask before it
    assert not state.finished
    state.apply_pass([5, 99, 6, 6], [True, False, False, False])  # settled: two masks left after it
    assert state.finished and state.finish_reason is FinishReason.EOS
    assert state.output_ids() == [7, 8, 9, 10, 5] and state.steps_used == 6 and state.blocks_done == 2


def test_an_eos_after_a_mask_does_not_end_early() -> None:
    state = _plain_state(prompt_len=4, new=4)
    state.apply_pass([5, 6, 99, 6], [False, False, True, False])  # EOS with two masks before it
    state.apply_pass([5, 6, 99, 6], [True, False, False, False])
    assert not state.finished and state.steps_used == 2
