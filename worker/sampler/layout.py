"""Where a request's generated region lies and which of its positions are fixed or restricted.

A plain request generates ``max_new_tokens`` after the prompt, rounded up to whole blocks
(aligned to absolute positions). A template request (infilling) generates exactly its template:
fixed tokens are committed up front, slots are masks, restricted slots only take allowed values.
Building the layout validates the request, so input problems surface as one clear error; it runs
in the submitting thread, so per-request setup (e.g. vocabulary masks) stays off the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.engine.types import GenerationRequest, InfillSlot, InfillTemplate, SlotConstraint


class RequestError(ValueError):
    """The request itself is invalid (reported in the result, never retried)."""


@dataclass(frozen=True)
class SequenceSlot:
    """A restricted slot: committed as one unit, choosing among ``candidates``."""

    index: int  # index into the template's slots
    start: int  # region-relative
    length: int
    candidates: tuple[tuple[int, ...], ...]  # each exactly ``length`` long (padded)


@dataclass(frozen=True)
class PadTailSlot:
    """A slot under the pad-tail rule (``worker/sampler/pad_tail.py``)."""

    index: int  # index into the template's slots
    start: int  # region-relative
    length: int
    min_tokens: int  # leading offsets that never take the pad
    pad_id: int
    content_mask: torch.Tensor  # [V] bool: the content ids (no pad), for offsets that need content


@dataclass(frozen=True)
class RegionLayout:
    """The generated region of one request (positions are region-relative unless named abs)."""

    region_start: int  # absolute position of the region's first token (= prompt length)
    region_len: int  # positions decoded (whole blocks for plain requests, the template otherwise)
    output_len: int  # the output is cut to this many tokens (max_new_tokens / template length)
    fixed: tuple[int | None, ...]  # [region_len] fixed token or None (masked)
    allowed_ids: tuple[torch.Tensor | None, ...]  # [region_len] per position: [V] bool mask or None
    sequence_slots: tuple[SequenceSlot, ...]
    slot_of_position: tuple[int, ...]  # [region_len] index into sequence_slots, -1 if none
    stop_at_eos: bool  # plain requests stop at a settled EOS (its block); templates never do
    unrestricted_slots: tuple[int, ...]  # template slot indexes decoded as plain masks
    pad_tail_slots: tuple[PadTailSlot, ...] = ()
    one_pass: bool = False  # every restricted slot decided in one pass over one span of blocks
    # the template's constraints with ``slots`` as indexes into ``sequence_slots``
    constraints: tuple[SlotConstraint, ...] = ()
    constraint_of: tuple[int, ...] = ()  # per sequence slot: its constraint's index, -1 if none

    @property
    def total_len(self) -> int:
        return self.region_start + self.region_len


def _check_params(request: GenerationRequest, block_size: int, vocab_size: int) -> None:
    p = request.params
    if block_size < 1:
        raise RequestError(f"block_size must be >= 1, got {block_size}")
    if p.steps_per_block is not None and p.steps_per_block < 1:  # None: the family's default
        raise RequestError(f"steps_per_block must be >= 1, got {p.steps_per_block}")
    if p.max_new_tokens < 1 and request.template is None:
        raise RequestError(f"max_new_tokens must be >= 1, got {p.max_new_tokens}")
    if p.strategy not in ("static", "dynamic", None):
        raise RequestError(f"strategy must be 'static' or 'dynamic', got {p.strategy!r}")
    if p.temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {p.temperature}")
    if p.top_k is not None and p.top_k < 0:
        raise RequestError(f"top_k must be >= 0, got {p.top_k}")
    if p.top_p is not None and not 0.0 < p.top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {p.top_p}")
    if p.step_budget is not None and p.step_budget < 0:
        raise RequestError(f"step_budget must be >= 0, got {p.step_budget}")
    bad = [t for t in request.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")


def _template_layout(template: InfillTemplate, start: int, vocab_size: int) -> RegionLayout:
    n = len(template.token_ids)
    if n == 0:
        raise RequestError("template is empty")
    fixed: list[int | None] = list(template.token_ids)
    allowed: list[torch.Tensor | None] = [None] * n
    slot_of: list[int] = [-1] * n
    seq_slots: list[SequenceSlot] = []
    unrestricted: list[int] = []
    tails: list[PadTailSlot] = []
    for i, slot in enumerate(template.slots):
        if slot.length < 1 or slot.start < 0 or slot.start + slot.length > n:
            raise RequestError(f"slot {i} ({slot.start}+{slot.length}) lies outside the template (len {n})")
        span = range(slot.start, slot.start + slot.length)
        if any(fixed[j] is None for j in span):
            raise RequestError(f"slot {i} overlaps another slot")
        for j in span:
            fixed[j] = None
        ids = slot.allowed_token_ids
        if ids is not None and slot.allowed_sequences is not None:
            raise RequestError(f"slot {i}: give allowed_sequences or allowed_token_ids, not both")
        if ids is not None:
            if not ids or any(not 0 <= t < vocab_size for t in ids):
                raise RequestError(f"slot {i}: allowed_token_ids empty or out of range")
            vocab_mask = torch.zeros(vocab_size, dtype=torch.bool)  # [V], built once per request
            vocab_mask[list(ids)] = True
            for j in span:
                allowed[j] = vocab_mask
        if slot.pad_tail:
            tail = _pad_tail_slot(i, slot, template.pad_id, vocab_size)
            with_pad = tail.content_mask | _one_hot(tail.pad_id, vocab_size)  # [V]
            for k, j in enumerate(span):
                allowed[j] = tail.content_mask if k < tail.min_tokens else with_pad
            tails.append(tail)
        if slot.allowed_sequences is None:
            unrestricted.append(i)
            continue
        candidates = []
        pad_id = template.pad_id
        for seq in slot.allowed_sequences:
            if len(seq) > slot.length or (len(seq) < slot.length and pad_id is None):
                raise RequestError(
                    f"slot {i}: allowed sequence of length {len(seq)} does not fit length {slot.length}"
                    " (shorter ones need the template's pad_id)"
                )
            # no pad_id: the sequence is full length (checked above)
            padded = tuple(seq) if pad_id is None else tuple(seq) + (pad_id,) * (slot.length - len(seq))
            if any(not 0 <= t < vocab_size for t in padded):
                raise RequestError(f"slot {i}: allowed sequence has token ids out of range")
            candidates.append(padded)
        if not candidates:
            raise RequestError(f"slot {i}: allowed_sequences is empty")
        for j in span:
            slot_of[j] = len(seq_slots)
        seq_slots.append(SequenceSlot(i, slot.start, slot.length, tuple(candidates)))
    if any(t is not None and not 0 <= t < vocab_size for t in fixed):
        raise RequestError("template has token ids out of range")
    if template.one_pass and (unrestricted or not seq_slots):
        raise RequestError("a one_pass template needs every slot restricted to allowed_sequences")
    constraints, constraint_of = _constraints(template, seq_slots)
    return RegionLayout(
        region_start=start,
        region_len=n,
        output_len=n,
        fixed=tuple(fixed),
        allowed_ids=tuple(allowed),
        sequence_slots=tuple(seq_slots),
        slot_of_position=tuple(slot_of),
        stop_at_eos=False,
        unrestricted_slots=tuple(unrestricted),
        pad_tail_slots=tuple(tails),
        one_pass=template.one_pass,
        constraints=constraints,
        constraint_of=constraint_of,
    )


def _constraints(
    template: InfillTemplate, seq_slots: list[SequenceSlot]
) -> tuple[tuple[SlotConstraint, ...], tuple[int, ...]]:
    """Check the template's constraints; return them over sequence-slot indexes, and each
    sequence slot's constraint (-1: none)."""
    sequence_index = {s.index: k for k, s in enumerate(seq_slots)}
    constraint_of = [-1] * len(seq_slots)
    mapped = []
    for n, constraint in enumerate(template.constraints):
        members = []
        for i in constraint.slots:
            k = sequence_index.get(i, -1)
            if k < 0:
                raise RequestError(f"constraint {n}: slot {i} is not a slot with allowed_sequences")
            if constraint_of[k] >= 0:
                raise RequestError(f"constraint {n}: slot {i} is in another constraint already")
            constraint_of[k] = n
            members.append(k)
        if len(members) < 2 or not constraint.allowed:
            raise RequestError(f"constraint {n}: needs two slots or more and an allowed combination")
        for combo in constraint.allowed:
            if len(combo) != len(members) or any(
                not 0 <= c < len(seq_slots[k].candidates) for c, k in zip(combo, members, strict=False)
            ):
                raise RequestError(f"constraint {n}: combination {combo} does not fit its slots' candidates")
        mapped.append(SlotConstraint(tuple(members), tuple(constraint.allowed)))
    return tuple(mapped), tuple(constraint_of)


def _one_hot(token: int, vocab_size: int) -> torch.Tensor:
    mask = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
    mask[token] = True
    return mask


def _pad_tail_slot(i: int, slot: InfillSlot, pad_id: int | None, vocab_size: int) -> PadTailSlot:
    """Check a pad-tail slot (content ids, a pad, a sane minimum) and build its masks."""
    if pad_id is None or not 0 <= pad_id < vocab_size:
        raise RequestError(f"slot {i}: a pad_tail slot needs the template's pad_id")
    if slot.allowed_token_ids is None or slot.allowed_sequences is not None:
        raise RequestError(f"slot {i}: a pad_tail slot needs allowed_token_ids (and no allowed_sequences)")
    if pad_id in slot.allowed_token_ids:
        raise RequestError(f"slot {i}: a pad_tail slot's content ids must not hold the pad")
    if not 0 <= slot.min_tokens <= slot.length:
        raise RequestError(f"slot {i}: min_tokens {slot.min_tokens} outside 0..{slot.length}")
    content = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
    content[list(slot.allowed_token_ids)] = True
    return PadTailSlot(i, slot.start, slot.length, slot.min_tokens, pad_id, content)


def build_layout(request: GenerationRequest, block_size: int, vocab_size: int, max_len: int) -> RegionLayout:
    """Validate ``request`` and lay out its generated region; raises RequestError."""
    _check_params(request, block_size, vocab_size)
    start = len(request.prompt_ids)
    if request.template is not None:
        layout = _template_layout(request.template, start, vocab_size)
    else:
        new = request.params.max_new_tokens
        end = -(-(start + new) // block_size) * block_size  # round up to a whole block
        layout = RegionLayout(
            region_start=start,
            region_len=end - start,
            output_len=new,
            fixed=(None,) * (end - start),
            allowed_ids=(None,) * (end - start),
            sequence_slots=(),
            slot_of_position=(-1,) * (end - start),
            stop_at_eos=True,
            unrestricted_slots=(),
        )
    if layout.total_len > max_len:
        raise RequestError(
            f"prompt + generated region = {layout.total_len} positions exceeds max_len {max_len}"
        )
    return layout
