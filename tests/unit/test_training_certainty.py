"""Certainty forcing (``train-demo --certainty``): the term is the temperature-scaled entropy at
right predictions only, it reaches generation rows' targets (first passes and chain links) and not
decision rows', and a step's loss is the cross-entropy mean plus the weighted terms over the same
denominator."""

from __future__ import annotations

import math

import pytest
import torch

from worker.model.checkpoint import load_checkpoint, read_config
from worker.model.demo_trained import TRAINED_CLOVER_DEMO
from worker.model.family import decoding_defaults
from worker.training.certainty import CERTAINTY_TEMPERATURE, certainty_term, certainty_weights
from worker.training.chain import draw_chain
from worker.training.passes import denoise
from worker.training.trainer import (
    TrainConfig,
    TrainConfigError,
    _batch,
    _noisy_batch,
    bucketed_loss,
    check_config,
)

# the shipped demo's block, as served: bucketed_loss chains with the model's own
BLOCK = decoding_defaults(read_config(TRAINED_CLOVER_DEMO)).block_size


def test_the_term_is_the_scaled_entropy_where_the_argmax_is_right() -> None:
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.0, 3.0, 0.0]]])  # [1, K=2, V=3]
    gold = torch.tensor([[0, 0]])  # the first prediction right, the second wrong
    got = certainty_term(logits, gold)
    scaled = [math.exp(x / CERTAINTY_TEMPERATURE) for x in (2.0, 0.0, -1.0)]
    probs = [x / sum(scaled) for x in scaled]
    assert float(got[0, 0]) == pytest.approx(-sum(p * math.log(p) for p in probs), rel=1e-6)
    assert float(got[0, 1]) == 0.0
    # its gradient sharpens the right prediction: the argmax's logit goes up against the others
    leaf = logits.clone().requires_grad_(True)
    certainty_term(leaf, gold).sum().backward()
    assert leaf.grad is not None
    assert float(leaf.grad[0, 0, 0]) < 0 < float(leaf.grad[0, 0, 1]) and not leaf.grad[0, 1].any()


def test_decision_rows_get_no_weight() -> None:
    lm = load_checkpoint(TRAINED_CLOVER_DEMO, dtype=torch.float32)
    rows = _batch(1, TrainConfig(batch=6, decision_share=0.5), lm.tokenizer, BLOCK)
    weights = certainty_weights(rows, 2.0, 12)  # [B, 12]
    assert any(row.units for row in rows) and any(not row.units for row in rows)
    for r, row in enumerate(rows):
        assert set(weights[r].tolist()) == ({0.0} if row.units else {2.0})


def test_a_step_s_loss_adds_the_terms_of_first_passes_and_links() -> None:
    """With chains, ``bucketed_loss`` with a certainty weight is the cross-entropy mean plus the
    weighted terms of every generation target (first passes and links) over the cross-entropy
    weights (decision targets counting 3, as ``--decision-weight 3``); a zero weight gives the loss
    without it."""
    torch.set_num_threads(1)
    lm = load_checkpoint(TRAINED_CLOVER_DEMO, dtype=torch.float32)
    mask = lm.config.mask_token_id
    assert mask is not None
    rows = _batch(1, TrainConfig(batch=6, decision_share=0.3), lm.tokenizer, BLOCK)
    gen = torch.Generator().manual_seed(1)
    noisy, clean, masked, commit, valid = _noisy_batch(rows, BLOCK, mask, gen, served_slots=True, chain=3)
    chain = draw_chain(rows, commit, BLOCK, mask, 3, gen)
    width = max(masked.shape[1], chain.width)
    weight = torch.tensor([3.0 if row.units else 1.0 for row in rows])[:, None].expand(-1, width).clone()
    certain = certainty_weights(rows, 0.5, width)
    with torch.no_grad():
        plain = bucketed_loss(lm.model, noisy, clean, masked, commit, valid, weight, 2, chain)
        zero = bucketed_loss(lm.model, noisy, clean, masked, commit, valid, weight, 2, chain, certain * 0)
        got = bucketed_loss(lm.model, noisy, clean, masked, commit, valid, weight, 2, chain, certain)
        first = denoise(lm.model, noisy, commit, valid)  # [B, T, V]
        terms = (certainty_term(first, clean) * masked * certain[:, : masked.shape[1]]).sum()
        count = float((masked * weight[:, : masked.shape[1]]).sum())  # the cross-entropy weights
        for r, blocks in enumerate(chain.blocks):  # each link as the long pass that commits its prefix
            for m in blocks:
                ids = chain.clean[r : r + 1, : (m + 1) * BLOCK].clone()
                ids[0, m * BLOCK :] = chain.noisy[r, m * BLOCK : (m + 1) * BLOCK]
                logits = denoise(lm.model, ids, torch.tensor([m * BLOCK]))[:, m * BLOCK :]  # [1, b, V]
                span = slice(m * BLOCK, (m + 1) * BLOCK)
                terms = terms + (certainty_term(logits, chain.clean[r : r + 1, span])[0]
                                 * chain.masked[r, span] * certain[r, span]).sum()  # fmt: skip
                count += float((chain.masked[r, span] * weight[r, span]).sum())
    assert sum(len(b) for b in chain.blocks) >= 2 and float(terms) > 0
    assert float(zero) == pytest.approx(float(plain), abs=1e-6)
    assert float(got) - float(plain) > 1e-3  # the term is not lost in the tolerance below
    assert float(got) == pytest.approx(float(plain) + float(terms) / count, abs=1e-5)


@pytest.mark.parametrize("options", [{"certainty": 1.0}, {"certainty": 0.0, "buckets": 2},
                                     {"certainty": float("nan"), "buckets": 2}])
def test_certainty_needs_buckets_and_a_positive_weight(options: dict[str, float]) -> None:
    with pytest.raises(TrainConfigError, match="certainty"):
        check_config(TrainConfig(**options))  # type: ignore[arg-type]
