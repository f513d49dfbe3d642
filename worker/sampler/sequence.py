"""The decoding state of one request: which block is current, what is committed, what is cached.

Pure bookkeeping over Python lists (no tensors except the request's own random generator), so
the engine's policy code never touches the device. One denoising pass of a row feeds
``tokens[cached_len : block_end]``: the committed-but-uncached tokens (the prompt's whole blocks
on the first pass, the previous block afterwards), whose K/V the pass appends to the cache, plus
the current block, whose masks it predicts. That fuses prefill and the commit of a finished
block with the next block's first pass; block-causal attention makes the outputs the same as
separate passes.

A restricted slot (a decision's answer choices) is chosen ONCE, as the argmax of (or a draw
from) the distribution over its candidates normalised together: each candidate's score is the
sum of the log-probabilities of its tokens at every position of the slot, read with the whole
slot still masked. A slot that crosses block boundaries is *deferred* in every block but its
last: those positions stay masks (uncommitted, not counted as the block's work, fed to the model
as mask tokens), the block's last pass scores every candidate on them, and the scores carry over
to the slot's last block, where the slot is decided over all its positions at once and its
tokens are written to every position. So the reported confidence is a proper probability over
the choices (never the product of per-block probabilities), and at temperature 0 the choice is
its argmax (confidence >= 1 / number of choices). The price: blocks after such a slot's first
block see its earlier positions as masks in their context (their K/V were cached as masks).

A ``one_pass`` template (every slot restricted) is decoded over one *span* instead: the blocks
from the first slot's block to the last slot's block are the current block of a single pass,
every slot position masked, the prefix up to the span committed; the pass decides every slot at
once (no deferral: each slot lies whole in the span) and the span completes. That is the pass a
model trained with ``--parallel-slots`` saw for a joint row (``worker.training.trainer.
parallel_decision``); a later slot no longer sees an earlier one's answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from worker.engine.types import FinishReason, GenerationRequest, Progress, SlotChoice
from worker.sampler.constraints import agreeing, candidates_left, choose_combination
from worker.sampler.layout import PadTailSlot, RegionLayout
from worker.sampler.pad_tail import content_required_before, forced_pads
from worker.sampler.schedule import plan_block_steps, step_quotas


@dataclass
class SlotDecision:
    """Running choice of a restricted slot that may span several blocks."""

    candidates: list[int]  # indexes into SequenceSlot.candidates still consistent
    confidence: float = 1.0
    chosen: int | None = None
    scores: list[float] = field(default_factory=list)  # per candidate: log-probs of earlier blocks


@dataclass
class SlotGroup:
    """The part of a restricted slot inside the current block, scored as one unit.

    ``final``: the block holds the slot's last positions, so the pass decides the slot (over
    ``prior`` + this block's log-probs, normalised over the candidates) and commits ``offsets``
    as one unit. Otherwise the positions are deferred: the runner only scores the candidates on
    them and writes the per-candidate sums to ``scores`` (the block's last pass is kept).
    """

    slot: int  # index into RegionLayout.sequence_slots
    offsets: list[int]  # block offsets of its still-masked (final) or deferred positions
    candidates: list[tuple[int, ...]]  # per consistent candidate: its tokens at ``offsets``
    candidate_ids: list[int] = field(default_factory=list)  # those candidates' indexes in the slot
    final: bool = True
    prior: list[float] | None = None  # per candidate: summed log-probs of its earlier blocks
    scores: list[float] | None = None  # set by the runner for a deferred or a scored group
    # a final group of a constrained slot: the runner reports its scores (prior included) too,
    # and the choice is made here over the allowed combinations (``_record_groups``)
    scored: bool = False


@dataclass
class PassInput:
    """What one row feeds into a denoising pass (host lists; the runner makes tensors)."""

    tokens: list[int]  # [commit_len + block_len] with mask ids at masked positions
    start_pos: int  # absolute position of tokens[0]
    commit_len: int  # leading tokens whose K/V this pass appends to the cache
    block_len: int  # current block's positions (trailing part of tokens)
    masked: list[bool]  # [block_len] positions still masked
    quota: int  # this step's k, capped at the masks left
    allowed_ids: list[torch.Tensor | None]  # [block_len] per position: [V] bool mask or None
    group_ids: list[int]  # [block_len] restricted-slot group (index into ``groups``) or -1
    groups: list[SlotGroup]  # restricted slots with masks in this block
    uniforms: torch.Tensor | None  # [max(block_size, block_len)] draws from the request's generator


@dataclass
class SequenceState:
    """Decoding state of one admitted request."""

    request: GenerationRequest
    layout: RegionLayout
    block_size: int
    mask_token_id: int
    eos_token_ids: frozenset[int]
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)  # [total_len]
    committed: list[bool] = field(default_factory=list)  # [region_len]
    cached_len: int = 0
    block_index: int = 0  # absolute block index of the current block
    quotas: list[int] = field(default_factory=list)
    step_in_block: int = 0
    steps_used: int = 0
    blocks_done: int = 0
    finish_reason: FinishReason | None = None
    slot_decisions: list[SlotDecision] = field(default_factory=list)
    block_masks_left: list[int] = field(default_factory=list)  # masks per region block
    deferred: list[bool] = field(default_factory=list)  # [region_len] slot positions decided later
    block_deferred: list[bool] = field(default_factory=list)  # per region block: holds deferred ones
    span: tuple[int, int] | None = None  # one_pass: (first, last) absolute block decoded as one
    _pass_groups: list[SlotGroup] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        request: GenerationRequest,
        layout: RegionLayout,
        *,
        block_size: int,
        mask_token_id: int,
        eos_token_ids: frozenset[int],
    ) -> SequenceState:
        seed = request.params.seed
        generator = torch.Generator(device="cpu")
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        state = cls(request, layout, block_size, mask_token_id, eos_token_ids, generator)
        fixed = layout.fixed
        state.tokens = list(request.prompt_ids) + [mask_token_id if t is None else t for t in fixed]
        state.committed = [t is not None for t in fixed]
        state.slot_decisions = [
            SlotDecision(list(range(len(s.candidates))), scores=[0.0] * len(s.candidates))
            for s in layout.sequence_slots
        ]
        r0 = layout.region_start
        state.deferred = [False] * layout.region_len
        slots = layout.sequence_slots
        if layout.one_pass:  # each slot lies whole in the span: nothing is deferred
            first_at = min(s.start for s in slots)
            last_at = max(s.start + s.length - 1 for s in slots)
            state.span = ((r0 + first_at) // block_size, (r0 + last_at) // block_size)
        else:
            for slot in slots:  # positions before the block of the slot's last one
                last_block = (r0 + slot.start + slot.length - 1) // block_size
                for j in range(slot.start, slot.start + slot.length):
                    state.deferred[j] = (r0 + j) // block_size < last_block
        first = r0 // block_size
        last = (layout.total_len - 1) // block_size
        spans = [(max(b * block_size - r0, 0), (b + 1) * block_size - r0) for b in range(first, last + 1)]
        state.block_masks_left = [
            sum(not c and not d for c, d in zip(state.committed[lo:hi], state.deferred[lo:hi], strict=True))
            for lo, hi in spans
        ]
        state.block_deferred = [any(state.deferred[lo:hi]) for lo, hi in spans]
        if state.span is not None:  # the span's masks count as its first block's
            lo, hi = state.span[0] - first, state.span[1] - first + 1
            state.block_masks_left[lo:hi] = [sum(state.block_masks_left[lo:hi])] + [0] * (hi - lo - 1)
        state.block_index = first
        state._begin_block()
        return state

    # ---- geometry --------------------------------------------------------------------------
    @property
    def first_block(self) -> int:
        return self.layout.region_start // self.block_size

    @property
    def block_start(self) -> int:
        return self.block_index * self.block_size

    @property
    def block_end(self) -> int:
        return min(self.block_start + self.blocks_in_pass * self.block_size, self.layout.total_len)

    @property
    def blocks_in_pass(self) -> int:
        """Blocks the current block covers: 1, or a one_pass span's count."""
        if self.span is None or self.block_index != self.span[0]:
            return 1
        return self.span[1] - self.span[0] + 1

    @property
    def in_span(self) -> bool:
        """The current block is a one_pass span (several blocks decoded as one)."""
        return self.span is not None and self.block_index == self.span[0]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def budget_left(self) -> int | None:
        budget = self.request.params.step_budget
        return None if budget is None else budget - self.steps_used

    # ---- block lifecycle -------------------------------------------------------------------
    def _block_masks(self) -> list[bool]:
        """[block_len] whether each position of the current block is still masked."""
        r0 = self.layout.region_start
        lo, hi = self.block_start, self.block_end
        head = max(r0 - lo, 0)  # prompt positions of a partial first block
        span = slice(lo + head - r0, hi - r0)
        return [False] * head + [
            not c and not d for c, d in zip(self.committed[span], self.deferred[span], strict=True)
        ]

    def _begin_block(self) -> None:
        """Plan the current block; blocks without masks complete at once (they cost no pass)."""
        while not self.finished:
            masks = sum(self._block_masks())
            index = self.block_index - self.first_block
            if masks == 0 and not self.block_deferred[index]:
                self._complete_block()
                continue
            blocks_left = sum(
                1
                for m, d in zip(self.block_masks_left[index:], self.block_deferred[index:], strict=True)
                if m > 0 or d
            )
            steps_per_block = self.request.params.steps_per_block
            if steps_per_block is None:  # the engine resolves the family's default before a sequence starts
                raise ValueError("steps_per_block is unresolved")
            # a span is decided in one pass, whatever the steps per block
            steps = plan_block_steps(1 if self.in_span else steps_per_block, blocks_left, self.budget_left)
            if steps == 0:
                self.finish_reason = FinishReason.BUDGET
                return
            # A block holding only deferred slot positions still gets one pass, which scores them.
            self.quotas = step_quotas(masks, steps) if masks else [0]
            self.step_in_block = 0
            return

    def _complete_block(self) -> None:
        blocks = self.blocks_in_pass  # a span completes all its blocks
        self.blocks_done += blocks
        layout = self.layout
        if layout.stop_at_eos:
            upto = min(self.block_end - layout.region_start, layout.output_len)
            if any(
                t in self.eos_token_ids for t in self.tokens[layout.region_start : layout.region_start + upto]
            ):
                self.finish_reason = FinishReason.EOS
                return
        if self.block_end >= layout.total_len:
            self.finish_reason = FinishReason.LENGTH
            return
        self.block_index += blocks

    # ---- passes ----------------------------------------------------------------------------
    def pass_input(self) -> PassInput:
        """The row this request feeds into the next denoising pass."""
        lo, hi = self.block_start, self.block_end
        r0 = self.layout.region_start
        masked = self._block_masks()
        quota = min(
            self.quotas[self.step_in_block], self.block_masks_left[self.block_index - self.first_block]
        )
        block_len = hi - lo
        allowed: list[torch.Tensor | None] = [None] * block_len
        group_ids = [-1] * block_len
        groups: list[SlotGroup] = []
        if self.request.template is not None:
            allowed = [self.layout.allowed_ids[p - r0] if p >= r0 else None for p in range(lo, hi)]
            if self.layout.pad_tail_slots:
                self._restrict_pad_tails(allowed)
            groups = self._slot_groups(masked, group_ids)
        self._pass_groups = groups
        uniforms = None
        if self.request.params.temperature > 0:  # [block_size], or [block_len] for a longer span
            uniforms = torch.rand(max(self.block_size, block_len), generator=self.generator)
        return PassInput(
            tokens=self.tokens[self.cached_len : hi],
            start_pos=self.cached_len,
            commit_len=lo - self.cached_len,
            block_len=block_len,
            masked=masked,
            quota=quota,
            allowed_ids=allowed,
            group_ids=group_ids,
            groups=groups,
            uniforms=uniforms,
        )

    def _tail_tokens(self, tail: PadTailSlot) -> list[int | None]:
        """A pad-tail slot's tokens, None where still masked."""
        r0 = self.layout.region_start
        span = range(tail.start, tail.start + tail.length)
        return [self.tokens[r0 + j] if self.committed[j] else None for j in span]

    def _restrict_pad_tails(self, allowed: list[torch.Tensor | None]) -> None:
        """Pad-tail rule, mask side: offsets before a committed content token lose the pad."""
        lo, r0 = self.block_start, self.layout.region_start
        for tail in self.layout.pad_tail_slots:
            first, end = r0 + tail.start, r0 + tail.start + tail.length
            if end <= lo or first >= lo + len(allowed):
                continue
            need = content_required_before(self._tail_tokens(tail), tail.pad_id, tail.min_tokens)
            for k in range(need):
                offset = first + k - lo
                if 0 <= offset < len(allowed):
                    allowed[offset] = tail.content_mask

    def _enforce_pad_tails(self) -> int:
        """Pad-tail rule, commit side: after the first committed pad every offset becomes a pad.
        Returns how many still-masked positions of the current block it committed (the other
        blocks' counts are updated here)."""
        r0, first_block = self.layout.region_start, self.first_block
        in_block = 0
        for tail in self.layout.pad_tail_slots:
            for k in forced_pads(self._tail_tokens(tail), tail.pad_id):
                j = tail.start + k
                if not self.committed[j]:
                    block = (r0 + j) // self.block_size
                    if block == self.block_index:
                        in_block += 1
                    else:
                        self.block_masks_left[block - first_block] -= 1
                self.tokens[r0 + j] = tail.pad_id
                self.committed[j] = True
        return in_block

    def _slot_groups(self, masked: list[bool], group_ids: list[int]) -> list[SlotGroup]:
        """Restricted slots with masks in the current block (fills ``group_ids`` in place)."""
        lo, r0 = self.block_start, self.layout.region_start
        groups: list[SlotGroup] = []
        index_of: dict[int, int] = {}
        for offset in range(len(masked)):
            j = lo + offset - r0
            s = self.layout.slot_of_position[j] if j >= 0 else -1
            deferred = j >= 0 and self.deferred[j] and not self.committed[j]
            if s < 0 or not (masked[offset] or deferred):
                continue
            if s not in index_of:
                index_of[s] = len(groups)
                groups.append(SlotGroup(slot=s, offsets=[], candidates=[], final=not deferred))
            groups[index_of[s]].offsets.append(offset)
            if not deferred:  # deferred positions are never committed in this block
                group_ids[offset] = index_of[s]
        for g in groups:
            slot = self.layout.sequence_slots[g.slot]
            decision = self.slot_decisions[g.slot]
            rel = [lo + o - r0 - slot.start for o in g.offsets]  # slot-relative
            g.candidates = [tuple(slot.candidates[c][k] for k in rel) for c in decision.candidates]
            g.candidate_ids = list(decision.candidates)  # a constraint may narrow the slot's list later
            if g.final and any(self.deferred[slot.start : slot.start + slot.length]):
                g.prior = [decision.scores[c] for c in decision.candidates]
            g.scored = g.final and bool(self.layout.constraints) and self.layout.constraint_of[g.slot] >= 0
        return groups

    def apply_pass(
        self,
        chosen: list[int],
        commit: list[bool],
        group_choices: Sequence[tuple[int, float]] = (),
    ) -> bool:
        """Record one pass's outcome; returns True when a block completed.

        chosen/commit: [block_len]; group_choices: per group of the pass input, the chosen
        candidate (index into that pass's candidate list) and its normalised probability.
        """
        lo = self.block_start
        self.cached_len = lo
        self.steps_used += 1
        self.step_in_block += 1
        r0 = self.layout.region_start
        offsets = [o for o, c in enumerate(commit) if c]
        for o in offsets:
            self.tokens[lo + o] = chosen[o]
            self.committed[lo + o - r0] = True
        if self._pass_groups:
            self._record_groups(offsets, group_choices)
        forced = self._enforce_pad_tails() if self.layout.pad_tail_slots and offsets else 0
        self.block_masks_left[self.block_index - self.first_block] -= len(offsets) + forced
        if self.block_masks_left[self.block_index - self.first_block] > 0 and not self._output_settled():
            if self.step_in_block >= len(self.quotas):
                raise RuntimeError("schedule exhausted with masks left (commit rule broke its quota)")
            return False
        self._carry_deferred_scores()
        self._complete_block()
        if not self.finished:
            self._begin_block()
        return True

    def _output_settled(self) -> bool:
        """A plain request whose current block holds a committed EOS with every position before
        it committed: ``output_ids`` ends there whatever the block's other masks become, so the
        block (and the request) is done without the passes that would only fill the positions
        after the EOS. Earlier blocks are whole and hold no EOS (the request would have ended)."""
        if not self.layout.stop_at_eos:
            return False
        r0 = self.layout.region_start
        for j in range(max(self.block_start - r0, 0), min(self.block_end - r0, self.layout.output_len)):
            if not self.committed[j]:
                return False
            if self.tokens[r0 + j] in self.eos_token_ids:
                return True
        return False

    def _record_groups(self, offsets: list[int], group_choices: Sequence[tuple[int, float]]) -> None:
        """Decide each restricted slot committed this pass: its choice, its probability among
        the candidates, and its tokens at the positions deferred in earlier blocks. A constrained
        slot's choice is made here over the allowed combinations (it may override the pass's
        pick), and all its positions are written from the chosen candidate."""
        done = set(offsets)
        r0 = self.layout.region_start
        decided = [
            (group, group.candidate_ids[choice], prob)
            for group, (choice, prob) in zip(self._pass_groups, group_choices, strict=True)
            if group.final and done.issuperset(group.offsets)
        ]
        constrained = {}
        if self.layout.constraints:
            constrained = self._constrained_choices([group.slot for group, _, _ in decided])
        for group, picked, prob in decided:
            picked, prob = constrained.get(group.slot, (picked, prob))
            decision = self.slot_decisions[group.slot]
            slot = self.layout.sequence_slots[group.slot]
            decision.candidates = [picked]
            decision.confidence = prob
            decision.chosen = picked
            for k in range(slot.length):  # a constrained pick may differ from the pass's tokens
                j = slot.start + k
                if (self.deferred[j] and not self.committed[j]) or group.slot in constrained:
                    self.tokens[r0 + j] = slot.candidates[picked][k]
                    self.committed[j] = True
        if constrained:
            self._narrow_constrained(constrained)

    def _constrained_choices(self, slots: list[int]) -> dict[int, tuple[int, float]]:
        """slot -> (candidate, probability) for the constrained ``slots`` decided this pass: per
        constraint, the best combination agreeing with its slots decided earlier, scored by this
        pass's final groups of its slots (``worker/sampler/constraints.py``)."""
        scores: dict[int, dict[int, float]] = {}  # sequence slot -> candidate -> score
        for group in self._pass_groups:
            if group.scored:
                if group.scores is None:
                    raise RuntimeError("a constrained restricted slot was not scored by the pass")
                scores[group.slot] = dict(zip(group.candidate_ids, group.scores, strict=True))
        picks: dict[int, tuple[int, float]] = {}
        for n in sorted({self.layout.constraint_of[s] for s in slots} - {-1}):
            constraint = self.layout.constraints[n]
            members = constraint.slots
            chosen_before = [self.slot_decisions[s].chosen for s in members]  # this pass's: still None
            earlier = {p: c for p, c in enumerate(chosen_before) if c is not None}
            combos = agreeing(constraint.allowed, earlier)
            u, temperature = None, self.request.params.temperature
            if temperature > 0:
                u = float(torch.rand(1, generator=self.generator))
            member_scores = {p: scores[s] for p, s in enumerate(members) if s in scores}
            chosen = choose_combination(combos, member_scores, u, temperature)
            picks.update({s: chosen[p] for p, s in enumerate(members) if s in slots})
        return picks

    def _narrow_constrained(self, picks: dict[int, tuple[int, float]]) -> None:
        """After constrained slots were decided, their constraints' undecided slots keep only the
        candidates of the combinations still allowed."""
        for n in sorted({self.layout.constraint_of[s] for s in picks}):
            constraint = self.layout.constraints[n]
            chosen = [self.slot_decisions[s].chosen for s in constraint.slots]
            combos = agreeing(constraint.allowed, {p: c for p, c in enumerate(chosen) if c is not None})
            for p, s in enumerate(constraint.slots):
                if chosen[p] is None:
                    decision = self.slot_decisions[s]
                    decision.candidates = candidates_left(combos, p, decision.candidates)

    def _carry_deferred_scores(self) -> None:
        """At a block's end, add its deferred positions' log-probs (scored by the block's last
        pass) to each candidate's running score."""
        for group in self._pass_groups:
            if group.final:
                continue
            if group.scores is None or len(group.scores) != len(group.candidates):
                raise RuntimeError("a deferred restricted slot was not scored by the pass")
            decision = self.slot_decisions[group.slot]
            for c, score in zip(group.candidate_ids, group.scores, strict=True):
                decision.scores[c] += score

    def finish(self, reason: FinishReason) -> None:
        if not self.finished:
            self.finish_reason = reason

    # ---- results ---------------------------------------------------------------------------
    def output_ids(self) -> list[int]:
        """Committed region tokens up to the first uncommitted one, cut to the output length and
        (plain requests) before the first EOS."""
        r0 = self.layout.region_start
        n = self.layout.output_len
        out: list[int] = []
        for j in range(n):
            if not self.committed[j]:
                break
            out.append(self.tokens[r0 + j])
        if self.layout.stop_at_eos:
            for i, t in enumerate(out):
                if t in self.eos_token_ids:
                    return out[:i]
        return out

    def slot_choices(self) -> list[SlotChoice]:
        """One entry per template slot (unrestricted slots get index -1)."""
        template = self.request.template
        if template is None:
            return []
        r0 = self.layout.region_start
        by_slot = {s.index: (k, s) for k, s in enumerate(self.layout.sequence_slots)}
        choices = []
        for i, slot in enumerate(template.slots):
            ids = self.tokens[r0 + slot.start : r0 + slot.start + slot.length]
            if i in by_slot:
                k, _ = by_slot[i]
                d = self.slot_decisions[k]
                index = d.chosen if d.chosen is not None else -1
                choices.append(SlotChoice(index=index, token_ids=ids, confidence=d.confidence))
            else:
                choices.append(SlotChoice(index=-1, token_ids=ids, confidence=1.0))
        return choices

    def progress(self) -> Progress:
        out = self.output_ids()
        return Progress(
            blocks_done=self.blocks_done,
            steps_used=self.steps_used,
            step_budget=self.request.params.step_budget,
            tokens_committed=len(out),
            committed_token_ids=out,
        )
