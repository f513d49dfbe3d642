"""Restricted infill slots (a decision's answer choices) on the tiny demo checkpoint.

A slot is chosen over the distribution of its candidates normalised together, for slots of any
length and across block boundaries: at temperature 0 the answer is that distribution's argmax
and its ``confidence`` the answer's probability under it (so never below 1 / choices); with
sampling the answer is drawn from it. The reference recomputes every block holding part of the
slot from scratch with the whole slot masked (``worker.engine.reference_decode.block_logits``, no
cache): each candidate's score is the sum of its tokens' log-probabilities at the slot's positions.
Both model families.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from worker.engine.engine import Engine, EngineConfig
from worker.engine.reference_decode import block_logits
from worker.engine.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    InfillSlot,
    InfillTemplate,
    SamplingParams,
)
from worker.model.checkpoint import LoadedModel, load_checkpoint


@pytest.fixture(scope="module")
def tiny(family_checkpoint: Path) -> LoadedModel:
    return load_checkpoint(family_checkpoint)


@pytest.fixture(scope="module")
def engine(tiny: LoadedModel) -> Iterator[Engine]:
    eng = Engine(
        tiny.model,
        EngineConfig(max_batch=16, max_len=512),
        mask_token_id=tiny.config.mask_token_id,
        eos_token_ids=tiny.config.eos_token_ids,
        default_block_size=tiny.config.block_size,
    )
    eng.start()
    yield eng
    eng.stop()


def _vocab(lm: LoadedModel) -> list[int]:
    special = {lm.config.mask_token_id, lm.config.pad_token_id, *lm.config.eos_token_ids}
    return [t for t in range(10, min(lm.config.vocab_size, 400)) if t not in special]


def _case(rng: random.Random, vocab: list[int], pad: int) -> tuple[list[int], InfillTemplate, int, int]:
    """A random prompt and a template whose only masked span is one restricted slot of 2-5
    choices, 1-6 tokens each (shorter ones padded). Returns (prompt, template, start, length)."""
    prompt = [rng.choice(vocab) for _ in range(rng.randint(1, 9))]
    length = rng.randint(1, 6)
    choices: set[tuple[int, ...]] = set()
    n = rng.randint(2, 5)
    while len(choices) < n:
        size = rng.randint(1, length)
        choices.add(tuple(rng.choice(vocab) for _ in range(size)))
    before = [rng.choice(vocab) for _ in range(rng.randint(0, 6))]
    after = [rng.choice(vocab) for _ in range(rng.randint(1, 5))]
    tokens = (*before, *(0,) * length, *after)
    slot = InfillSlot(len(before), length, allowed_sequences=tuple(sorted(choices)))
    return prompt, InfillTemplate(tokens, (slot,), pad_id=pad), len(before), length


def _reference(lm: LoadedModel, prompt: list[int], template: InfillTemplate, block: int) -> torch.Tensor:
    """softmax over the candidates of one slot: summed log-probs with the slot masked."""
    (slot,) = template.slots
    mask = lm.config.mask_token_id
    r0 = len(prompt)
    region = list(template.token_ids)
    for j in range(slot.start, slot.start + slot.length):
        region[j] = mask
    seq = torch.tensor([prompt + region])
    first, last = r0 + slot.start, r0 + slot.start + slot.length - 1
    logp = torch.zeros(last + 1, lm.config.vocab_size)  # rows of the slot's positions are filled
    with torch.no_grad():
        for b in range(first // block, last // block + 1):
            lo, hi = b * block, min((b + 1) * block, seq.shape[1])
            logits = block_logits(lm.model, seq, lo, hi, block)[0].float()  # [hi - lo, V]
            logits[:, mask] = float("-inf")
            rows = torch.log_softmax(logits, dim=-1)
            top = min(hi, last + 1)
            logp[lo:top] = rows[: top - lo]
    assert slot.allowed_sequences is not None
    scores = []
    for seq_ids in slot.allowed_sequences:
        padded = (*seq_ids, *(template.pad_id,) * (slot.length - len(seq_ids)))  # type: ignore[arg-type]
        scores.append(sum(logp[first + k, t] for k, t in enumerate(padded)))
    return torch.softmax(torch.stack(scores), dim=-1)


def _run(engine: Engine, prompt: list[int], template: InfillTemplate, **params: object) -> GenerationResult:
    request = GenerationRequest("slot", prompt, SamplingParams(**params), template=template)  # type: ignore[arg-type]
    result = engine.submit(request).result(timeout=120)
    assert result.error is None and result.finish_reason is FinishReason.LENGTH
    return result


@pytest.mark.parametrize("block", [4, 2, 8, 1])
def test_greedy_choice_is_the_argmax_of_the_normalised_choices(
    tiny: LoadedModel, engine: Engine, block: int
) -> None:
    rng = random.Random(1000 + block)
    vocab = _vocab(tiny)
    crossing = 0
    for _ in range(40):
        prompt, template, start, length = _case(rng, vocab, tiny.config.pad_token_id)
        r0 = len(prompt)
        crossing += (r0 + start) // block != (r0 + start + length - 1) // block
        result = _run(engine, prompt, template, block_size=block, steps_per_block=rng.randint(1, 4))
        (choice,) = result.slot_choices
        probs = _reference(tiny, prompt, template, block)
        n = len(probs)
        assert choice.confidence >= 1.0 / n - 1e-6
        assert choice.confidence == pytest.approx(float(probs[choice.index]), abs=2e-4)
        top = torch.topk(probs, 2).values
        if float(top[0] - top[1]) > 1e-4:  # not a numerical tie
            assert choice.index == int(probs.argmax())
        slot = template.slots[0]
        assert slot.allowed_sequences is not None
        chosen = slot.allowed_sequences[choice.index]
        padded = [*chosen, *(tiny.config.pad_token_id,) * (length - len(chosen))]
        assert result.token_ids[start : start + length] == padded == choice.token_ids
        assert abs(sum(probs.tolist()) - 1.0) < 1e-5
    if block < 8:
        assert crossing >= 10  # the cases exercise slots across block boundaries


def test_confidence_is_at_least_one_over_the_choices_in_busy_templates(
    tiny: LoadedModel, engine: Engine
) -> None:
    """Several restricted slots crossing blocks of 4 next to free slots and token-restricted
    ones, decoded in a shared batch with any steps: every answer is >= 1/n and spelled out."""
    rng = random.Random(7)
    vocab = _vocab(tiny)
    pad = tiny.config.pad_token_id
    futures = []
    for i in range(48):
        tokens: list[int] = []
        slots: list[InfillSlot] = []
        for _ in range(rng.randint(1, 3)):
            tokens += [rng.choice(vocab) for _ in range(rng.randint(0, 3))]
            length = rng.randint(1, 7)
            choices = {tuple(rng.choice(vocab) for _ in range(rng.randint(1, length)))
                       for _ in range(rng.randint(2, 4))}
            slots.append(InfillSlot(len(tokens), length, allowed_sequences=tuple(sorted(choices))))
            tokens += [0] * length
            if rng.random() < 0.5:
                free = rng.randint(1, 3)
                ids = tuple(rng.sample(vocab, 3)) if rng.random() < 0.5 else None
                slots.append(InfillSlot(len(tokens), free, allowed_token_ids=ids))
                tokens += [0] * free
        tokens += [rng.choice(vocab)]
        prompt = [rng.choice(vocab) for _ in range(rng.randint(1, 7))]
        params = SamplingParams(block_size=rng.choice([2, 4, 4, 8]), steps_per_block=rng.randint(1, 4),
                                strategy=rng.choice(["static", "dynamic"]), threshold=0.3)
        template = InfillTemplate(tuple(tokens), tuple(slots), pad_id=pad)
        request = GenerationRequest(f"busy{i}", prompt, params, template=template)
        futures.append((template, engine.submit(request)))
    for template, future in futures:
        result = future.result(timeout=120)
        assert result.error is None and result.finish_reason is FinishReason.LENGTH
        assert tiny.config.mask_token_id not in result.token_ids
        for slot, choice in zip(template.slots, result.slot_choices, strict=True):
            if slot.allowed_sequences is None:
                assert choice.index == -1
                continue
            n = len(slot.allowed_sequences)
            assert 0 <= choice.index < n
            assert 1.0 / n - 1e-6 <= choice.confidence <= 1.0 + 1e-6
            chosen = slot.allowed_sequences[choice.index]
            assert choice.token_ids == [*chosen, *(pad,) * (slot.length - len(chosen))]
            assert result.token_ids[slot.start : slot.start + slot.length] == choice.token_ids


def test_sampling_draws_from_the_normalised_choices(tiny: LoadedModel, engine: Engine) -> None:
    """At temperature 1 the answer of a slot crossing blocks of 4 follows the reference
    distribution, and its confidence is the drawn answer's probability under it."""
    pad = tiny.config.pad_token_id
    rng = random.Random(3)
    vocab = _vocab(tiny)
    prompt = [rng.choice(vocab) for _ in range(3)]  # region starts at 3: the slot spans 3..8
    choices = tuple(sorted({tuple(rng.choice(vocab) for _ in range(rng.randint(1, 6))) for _ in range(3)}))
    template = InfillTemplate((0, 0, 0, 0, 0, 0, rng.choice(vocab)), (InfillSlot(0, 6, choices),), pad_id=pad)
    probs = _reference(tiny, prompt, template, 4)
    assert len(choices) >= 2 and len(probs) == len(choices)  # a draw among several, each with its share
    runs = 300
    sampled = [SamplingParams(block_size=4, steps_per_block=2, temperature=1.0, seed=s) for s in range(runs)]
    futures = [engine.submit(GenerationRequest(f"s{i}", prompt, p, template=template))
               for i, p in enumerate(sampled)]
    assert len(futures) == runs
    counts: Counter[int] = Counter()
    for future in futures:
        (choice,) = future.result(timeout=120).slot_choices
        counts[choice.index] += 1
        assert choice.confidence == pytest.approx(float(probs[choice.index]), abs=2e-4)
    assert sum(counts.values()) == runs  # every run answered (the loops above and below saw data)
    for index, p in enumerate(probs.tolist()):
        sd = (p * (1 - p) / runs) ** 0.5
        assert abs(counts[index] / runs - p) <= 4 * sd + 0.01, (counts, probs)


@pytest.mark.parametrize("choices", [2, 3, 5])
def test_choices_sharing_their_first_block_are_not_split_by_it(
    tiny: LoadedModel, engine: Engine, choices: int
) -> None:
    """The newcomer's case: answers that start with the same token (a quote, say) in one
    block and differ in the next. Scoring the first block alone gives each answer 1/n there, and
    multiplying by the second block's share put the confidence below 1/n."""
    rng = random.Random(choices)
    vocab = _vocab(tiny)
    for trial in range(10):
        quote = rng.choice(vocab)
        answers = tuple((quote, t) for t in rng.sample(vocab, choices))
        prompt = [rng.choice(vocab) for _ in range(3 + trial % 4)]
        lead = (-len(prompt) - 1) % 4  # the quote ends a block of 4, the answers' ids open the next
        before = tuple(rng.choice(vocab) for _ in range(lead))
        template = InfillTemplate((*before, 0, 0, rng.choice(vocab)), (InfillSlot(lead, 2, answers),))
        result = _run(engine, prompt, template, block_size=4, steps_per_block=2)
        (choice,) = result.slot_choices
        probs = _reference(tiny, prompt, template, 4)
        assert choice.confidence >= 1.0 / choices - 1e-6
        assert choice.index == int(probs.argmax())
        assert choice.confidence == pytest.approx(float(probs.max()), abs=2e-4)


def test_a_one_pass_template_decides_every_slot_from_one_pass_over_its_span(
    tiny: LoadedModel, engine: Engine
) -> None:
    """``InfillTemplate.one_pass``: every slot masked, the prefix committed up to the first slot's
    block, ONE pass over the blocks up to the last slot's; each slot's choice is the argmax of its
    candidates' summed log-probs in that pass (the reference: ``block_logits`` over the span)."""
    rng = random.Random(77)
    vocab, pad, mask, block = _vocab(tiny), tiny.config.pad_token_id, tiny.config.mask_token_id, 4
    for _ in range(12):
        prompt = [rng.choice(vocab) for _ in range(rng.randint(1, 9))]
        tokens: list[int] = [rng.choice(vocab) for _ in range(rng.randint(0, 5))]
        slots = []
        for _ in range(rng.randint(2, 3)):
            length = rng.randint(1, 4)
            choices = {tuple(rng.choice(vocab) for _ in range(rng.randint(1, length))) for _ in range(3)}
            slots.append(InfillSlot(len(tokens), length, allowed_sequences=tuple(sorted(choices))))
            tokens += [0] * length + [rng.choice(vocab) for _ in range(rng.randint(1, 6))]
        template = InfillTemplate(tuple(tokens), tuple(slots), pad_id=pad, one_pass=True)
        result = _run(engine, prompt, template, block_size=block, steps_per_block=rng.randint(1, 4))
        r0 = len(prompt)
        lo = (r0 + slots[0].start) // block * block
        hi = min(((r0 + slots[-1].start + slots[-1].length - 1) // block + 1) * block, r0 + len(tokens))
        assert result.steps_used == 1
        seq = torch.tensor([prompt + [mask if any(s.start <= j < s.start + s.length for s in slots) else t
                                      for j, t in enumerate(tokens)]])  # fmt: skip
        with torch.no_grad():
            logits = block_logits(tiny.model, seq, lo, hi, block)[0].float()  # [hi - lo, V]
        logits[:, mask] = float("-inf")
        logp = torch.log_softmax(logits, dim=-1)
        for slot, choice in zip(slots, result.slot_choices, strict=True):
            assert slot.allowed_sequences is not None
            padded = [(*c, *(pad,) * (slot.length - len(c))) for c in slot.allowed_sequences]
            at = r0 + slot.start - lo
            scores = torch.stack([sum(logp[at + k, t] for k, t in enumerate(c)) for c in padded])
            probs = torch.softmax(scores, dim=-1)
            assert choice.confidence == pytest.approx(float(probs[choice.index]), abs=2e-4)
            top = torch.topk(probs, 2).values if len(probs) > 1 else probs
            if len(probs) == 1 or float(top[0] - top[1]) > 1e-4:
                assert choice.index == int(probs.argmax())
