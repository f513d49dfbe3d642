"""The model runner: turns the rows of one denoising pass into batched forwards and decisions.

It never decides policy (who runs, when a request ends): it receives each row's ``PassInput``
and returns, per row, the token chosen at every block position and which positions to commit.
All active rows go through one forward padded to the longest row; rows that feed a long
prefill or attend over a long context go to a second forward, after the others, when padding
them together would waste more than half of the work (``pass_groups.py``). Per-row sampling
and commit rules run batched on the device.

Per forward the host writes every row's inputs into persistent staging buffers (``_Staging``:
one int64 and one float32 buffer, pinned on CUDA, grown to the largest batch seen and then
reused) and sends them in one copy per dtype; positions, the validity mask and the logits index
are derived on the device from one cached ``arange``. The host receives ONE copy per forward
(tokens, commit flags and restricted-slot scores packed together); the model forward itself
syncs once more (its cache view's lengths).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from worker.engine.forward_cost import CALIBRATION_REPEATS, ForwardCost, fit_token_keys
from worker.engine.pass_groups import split_pass
from worker.model.family import DiffusionModel
from worker.model.kv_cache import KVCache
from worker.sampler.commit import choose_commits, expand_to_groups
from worker.sampler.selection import RowSampling, select_tokens
from worker.sampler.sequence import PassInput


@dataclass(frozen=True)
class RowSpec:
    """One row of a pass: where its cache lives, what it feeds, how it samples."""

    slot: int
    block_size: int
    temperature: float
    top_k: int  # 0 = off
    top_p: float  # 1.0 = off
    dynamic: bool
    threshold: float
    inp: PassInput


@dataclass(frozen=True)
class RowOutcome:
    """Decisions of one row: [block_len] tokens and commit flags, plus restricted-slot picks."""

    chosen: list[int]
    commit: list[bool]
    group_choices: list[tuple[int, float]]


@dataclass
class PassTimings:
    """Wall time of the model forwards inside one pass (the rest is engine overhead)."""

    forward_seconds: float = 0.0
    forwards: int = 0


class _Staging:
    """A persistent host buffer of one dtype (pinned on CUDA) and its device twin.

    Why: building each per-pass input as its own small tensor cost a dozen-odd host tensors and
    host-to-device copies per pass. Here the host writes every input of a forward into
    ``host(n)`` (a numpy view: assigning Python lists to it is fast), and ``upload(n)`` sends the
    whole lot to the device in one copy. Capacity grows to the next power of two and is kept
    (a few dozen elements per row). On CPU the host buffer *is* the device buffer: no copy.
    The views handed out are valid until the next ``host`` call.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self._cuda = device.type == "cuda"
        self._host = torch.empty(0, dtype=dtype)
        self._dev = self._host
        self._array: np.ndarray = self._host.numpy()
        self._uploaded: torch.cuda.Event | None = None  # the last non-blocking copy out of _host

    def host(self, n: int) -> np.ndarray:
        """``[n]`` host elements to write this forward's inputs into (contents undefined)."""
        if self._uploaded is not None:  # normally long done: the last pass copied its results back
            self._uploaded.synchronize()
            self._uploaded = None
        if n > self._host.numel():
            size = 1 << max(n - 1, 63).bit_length()  # >= 64 elements, a power of two
            self._host = torch.empty(size, dtype=self.dtype, pin_memory=self._cuda)
            self._dev = torch.empty(size, dtype=self.dtype, device=self.device) if self._cuda else self._host
            self._array = self._host.numpy()
        return self._array[:n]

    def upload(self, n: int) -> Tensor:
        """The first ``n`` host elements on the device (one copy; none on CPU): ``[n]``."""
        if not self._cuda:
            return self._host[:n]
        dev = self._dev[:n]
        dev.copy_(self._host[:n], non_blocking=True)
        self._uploaded = torch.cuda.Event()
        self._uploaded.record()
        return dev


@dataclass(frozen=True)
class _ForwardInputs:
    """One forward's inputs on the device (views of the staging buffers; R rows, T tokens,
    Bmax block positions)."""

    ids: Tensor  # [R, T] long, mask ids as padding
    positions: Tensor  # [R, T] long absolute positions
    block_ids: Tensor  # [R, T] long
    valid: Tensor  # [R, T] bool, False = padding
    slots: Tensor  # [R] long
    commit_lens: Tensor  # [R] long
    offsets: Tensor  # [R, Bmax] long: the block's token indices (logits_index)
    masked: Tensor  # [R, Bmax] bool
    group_ids: Tensor  # [R, Bmax] long, -1 = no restricted slot
    quota: Tensor  # [R] long
    threshold: Tensor  # [R] float32
    dynamic: Tensor  # [R] bool
    uniforms: Tensor  # [R, Bmax] float32 (0 where a row draws nothing)
    sampling: RowSampling


# per-row int64 scalars of a forward, one contiguous [R] column each (in the staging buffer)
_START, _COMMIT, _BLOCK, _SLOT, _QUOTA, _TOP_K, _DYNAMIC, _COUNT = range(8)
_SCALARS = 8


class ModelRunner:
    """Owns the model and its KV cache; runs passes for the engine thread."""

    def __init__(self, model: DiffusionModel, cache: KVCache, *, mask_token_id: int,
                 token_work_keys: int = 0) -> None:
        self.model = model
        self.cache = cache
        self.mask_token_id = mask_token_id
        self.device = cache.device
        cfg = model.config
        self.router_counts = torch.zeros(  # [L, E] tokens routed per layer and expert
            cfg.num_hidden_layers, max(cfg.num_experts, 1), dtype=torch.long, device=self.device
        )
        self._sync = self.device.type == "cuda"
        self._longs = _Staging(torch.long, self.device)  # a forward's int64 inputs
        self._floats = _Staging(torch.float32, self.device)  # a forward's float32 inputs
        self._slots = _Staging(torch.long, self.device)  # a pass's slots (held across its forwards)
        self._arange = torch.arange(64, device=self.device)  # [N] 0..N-1, grown on demand
        # a forward's cost model (forward_cost.py): fixed by the operator, or measured by
        # calibrate_forward_cost before the engine's first prefill chunk (Engine.calibrate)
        self.forward_cost = ForwardCost(token_work_keys) if token_work_keys > 0 else ForwardCost()

    def calibrate_forward_cost(self, slot: int, *, block: int, budget: int, depth: int) -> int | None:
        """Measure ``W`` (``forward_cost.py``) on the empty cache ``slot`` and use it from now on:
        single-row prefill forwards of ``budget`` tokens and an eighth of it (whole blocks), at
        context 0 and ``depth``, five times each (the cache restored after each), after one
        untimed forward; returns the figure, or None (and the cost model unchanged) when the
        forwards could not tell it. Not thread-safe: the engine's thread calls it
        (``Engine.calibrate``, which also decides whether it is needed)."""
        big = max(budget // block, 1) * block
        small = max(big // 8 // block, 1) * block
        vocab = self.model.config.vocab_size
        prompt = [t if t != self.mask_token_id else (t + 1) % vocab
                  for t in ((13 * j + 5) % vocab for j in range(depth + big))]
        slots = torch.tensor([slot], dtype=torch.long, device=self.device)
        samples: list[tuple[int, int, float]] = []

        def timed(tokens: int, context: int) -> float:
            before = self.cache.snapshot(slots)
            timings = PassTimings()
            self.run_prefill(slot, prompt[context:context + tokens], context, block, timings)
            self.cache.restore(slots, before)
            return timings.forward_seconds

        with torch.inference_mode():
            timed(big, 0)  # warm-up: allocation, kernel selection
            for context in (0, depth):
                for at in range(0, context, big):  # reach the depth (the slot is empty before)
                    self.run_prefill(slot, prompt[at:min(at + big, context)], at, block, PassTimings())
                for _ in range(CALIBRATION_REPEATS):
                    samples += [(tokens, context, timed(tokens, context)) for tokens in (small, big)]
        measured = fit_token_keys(samples)
        if measured is not None:
            self.forward_cost = ForwardCost(measured)
        return measured

    def _iota(self, n: int) -> Tensor:
        """``arange(n)`` on the device, sliced from one cached tensor: ``[n]`` long."""
        if n > self._arange.numel():
            self._arange = torch.arange(1 << (n - 1).bit_length(), device=self.device)
        return self._arange[:n]

    def run_pass(self, rows: list[RowSpec], timings: PassTimings) -> list[RowOutcome]:
        """One denoising pass for ``rows`` (one or two forwards); outcomes in row order. On an
        exception the rows' committed state (cache lengths, and GDN states of a hybrid cache) is
        as before the pass, so it can be re-run."""
        groups = split_pass([len(r.inp.tokens) for r in rows], [r.inp.start_pos for r in rows],
                            self.forward_cost)
        outcomes: dict[int, RowOutcome] = {}
        self._slots.host(len(rows))[:] = [row.slot for row in rows]
        slots = self._slots.upload(len(rows))  # [R]
        before = self.cache.snapshot(slots)
        try:
            for members in groups:
                for i, outcome in zip(
                    members, self._run_group([rows[i] for i in members], timings), strict=True
                ):
                    outcomes[i] = outcome
        except BaseException:
            # A pass is all or nothing for the cache: the forward commits the rows' positions
            # before the decisions run (and a split pass runs two forwards), so a fault after that
            # point would leave them committed and the engine's row-by-row retry would commit them
            # a second time. K/V written past the restored lengths are invisible; a hybrid cache
            # also returns to the GDN state copies it held before (the commit wrote the others).
            self.cache.restore(slots, before)
            raise
        return [outcomes[i] for i in range(len(rows))]

    def run_prefill(self, slot: int, tokens: list[int], start_pos: int, block_size: int,
                    timings: PassTimings) -> None:
        """Commit ``tokens`` (whole prompt blocks from ``start_pos``) into ``slot``: a shared prefix
        computed once for the prefix cache. The same forward as a pass's commit rows, with no block
        to denoise (the logits of one position are computed and dropped). On an exception the slot's
        committed state is as before."""
        dev = self.device
        t = len(tokens)
        ids = torch.tensor([tokens], dtype=torch.long, device=dev)  # [1, T]
        positions = start_pos + torch.arange(t, device=dev)[None, :]  # [1, T]
        slots = torch.tensor([slot], dtype=torch.long, device=dev)  # [1]
        before = self.cache.snapshot(slots)
        began = time.perf_counter()
        try:
            self.model(
                ids,
                positions,
                positions // block_size,
                valid=torch.ones(1, t, dtype=torch.bool, device=dev),
                cache=self.cache,
                slots=slots,
                commit_lens=torch.tensor([t], dtype=torch.long, device=dev),
                router_counts=self.router_counts if self.model.config.num_experts > 0 else None,
                logits_index=torch.zeros(1, 1, dtype=torch.long, device=dev),
            )
            if self._sync:
                torch.cuda.synchronize(dev)
        except BaseException:
            self.cache.restore(slots, before)
            raise
        timings.forward_seconds += time.perf_counter() - began  # synchronized on CUDA
        timings.forwards += 1

    def _stage(self, rows: list[RowSpec], t: int, bmax: int) -> _ForwardInputs:
        """Write the rows' inputs into the staging buffers, send them (one copy per dtype) and
        derive the rest on the device.

        int64 layout:   ids [R*T] | masked [R*Bmax] | group_ids [R*Bmax] | scalars [8*R] |
                        filtered positions [N] (row * Bmax + offset) | sampling rows [S]
        float32 layout: uniforms [R*Bmax] | temperature [R] | top_p [R] | threshold [R]
        """
        r = len(rows)
        # top-k/top-p sort the vocabulary: only at the masked positions of the rows that filter
        filter_at = [
            i * bmax + o
            for i, row in enumerate(rows)
            if row.top_k > 0 or row.top_p < 1.0
            for o, m in enumerate(row.inp.masked)
            if m
        ]
        sample_rows = [i for i, row in enumerate(rows) if row.temperature > 0]
        n_ids, n_block = r * t, r * bmax
        at_scalars = n_ids + 2 * n_block
        at_rows = at_scalars + _SCALARS * r
        n_long = at_rows + len(filter_at) + len(sample_rows)
        n_float = n_block + 3 * r

        longs = self._longs.host(n_long)
        ids = longs[:n_ids].reshape(r, t)
        masked = longs[n_ids : n_ids + n_block].reshape(r, bmax)
        group_ids = longs[n_ids + n_block : at_scalars].reshape(r, bmax)
        scalars = longs[at_scalars:at_rows].reshape(_SCALARS, r)
        ids.fill(self.mask_token_id)
        masked.fill(0)
        group_ids.fill(-1)
        floats = self._floats.host(n_float)
        uniforms = floats[:n_block].reshape(r, bmax)
        uniforms.fill(0.0)
        for i, row in enumerate(rows):
            p = row.inp
            n, b = len(p.tokens), p.block_len
            ids[i, :n] = p.tokens
            masked[i, :b] = p.masked
            group_ids[i, :b] = p.group_ids
            scalars[:, i] = (p.start_pos, p.commit_len, row.block_size, row.slot, p.quota, row.top_k,
                             row.dynamic, n)
            if p.uniforms is not None:
                uniforms[i, :b] = p.uniforms[:b].numpy()
        longs[at_rows:] = filter_at + sample_rows
        floats[n_block:] = (
            [row.temperature for row in rows] + [row.top_p for row in rows] + [row.threshold for row in rows]
        )

        dl, df = self._longs.upload(n_long), self._floats.upload(n_float)
        col = dl[at_scalars:at_rows].view(_SCALARS, r)  # [8, R]
        start, commit_lens, count = col[_START], col[_COMMIT], col[_COUNT]
        iota = self._iota(max(t, bmax))
        positions = start[:, None] + iota[None, :t]  # [R, T]
        at_sample = at_rows + len(filter_at)
        temperature, top_p = df[n_block : n_block + r], df[n_block + r : n_block + 2 * r]
        return _ForwardInputs(
            ids=dl[:n_ids].view(r, t),
            positions=positions,
            block_ids=positions // col[_BLOCK][:, None],  # [R, T]
            valid=iota[None, :t] < count[:, None],  # [R, T]
            slots=col[_SLOT],
            commit_lens=commit_lens,
            offsets=(commit_lens[:, None] + iota[None, :bmax]).clamp(max=t - 1),  # [R, Bmax]
            masked=dl[n_ids : n_ids + n_block].view(r, bmax) != 0,
            group_ids=dl[n_ids + n_block : at_scalars].view(r, bmax),
            quota=col[_QUOTA],
            threshold=df[n_block + 2 * r : n_block + 3 * r],
            dynamic=col[_DYNAMIC] != 0,
            uniforms=df[:n_block].view(r, bmax),
            sampling=RowSampling(
                temperature=temperature,
                top_k=col[_TOP_K],
                top_p=top_p,
                filtering=bool(filter_at),
                sampling=bool(sample_rows),
                filter_at=dl[at_rows:at_sample],
                sample_rows=dl[at_sample:n_long] if len(sample_rows) < r else None,
            ),
        )

    def _run_group(self, rows: list[RowSpec], timings: PassTimings) -> list[RowOutcome]:
        r = len(rows)
        t = max(len(row.inp.tokens) for row in rows)
        bmax = max(row.inp.block_len for row in rows)
        inp = self._stage(rows, t, bmax)  # one copy per dtype to the device

        # ---- the forward: logits only for each row's current block ---------------------------
        began = time.perf_counter()
        block_logits = self.model(
            inp.ids,
            inp.positions,
            inp.block_ids,
            valid=inp.valid,
            cache=self.cache,
            slots=inp.slots,
            commit_lens=inp.commit_lens,
            router_counts=self.router_counts if self.model.config.num_experts > 0 else None,
            logits_index=inp.offsets,
        )  # [R, Bmax, V]
        if self._sync:
            torch.cuda.synchronize(self.device)
        timings.forward_seconds += time.perf_counter() - began
        timings.forwards += 1

        # ---- decisions (in place on the logits: no other [R, Bmax, V] tensor when greedy) ----
        block_logits[..., self.mask_token_id] = float("-inf")  # never commit a mask token
        self._restrict_ids(block_logits, rows)
        tokens, confidence = select_tokens(block_logits, inp.sampling, inp.uniforms)  # [R, Bmax] x2
        group_picks, scored = self._choose_sequences(block_logits, rows, tokens, confidence, inp.uniforms)
        commit = choose_commits(confidence, inp.masked, inp.quota, inp.threshold, inp.dynamic)  # [R, Bmax]
        num_groups = max((len(row.inp.groups) for row in rows), default=0)
        if num_groups:
            commit = expand_to_groups(commit, inp.group_ids, num_groups)

        # ---- ONE device-to-host copy for everything the host needs from this pass -------------
        # int64: tokens [R*Bmax], commit flags [R*Bmax]; then the float64 candidate picks
        # [R*G*2] and the scores of deferred and constrained slots, carried as their int64 bit patterns
        parts = [tokens.reshape(-1), commit.reshape(-1).to(torch.long)]
        floats = ([group_picks.reshape(-1)] if group_picks is not None else []) + [
            scores.to(torch.float64) for _, _, scores in scored
        ]
        if floats:
            parts.append(torch.cat(floats).view(torch.long))
        host = torch.cat(parts).cpu().numpy()  # the pass's only host sync outside the forward
        n_block = r * bmax
        tokens_host = host[:n_block].reshape(r, bmax)
        commit_host = host[n_block : 2 * n_block].reshape(r, bmax).astype(bool)
        floats_host = host[2 * n_block :].view(np.float64)
        at = 0
        picks_host = None
        if group_picks is not None:
            at = group_picks.numel()
            picks_host = floats_host[:at].reshape(group_picks.shape).tolist()  # [R, G, 2]
        for i, g, scores in scored:  # per-candidate sums: deferred slot positions, constrained slots
            rows[i].inp.groups[g].scores = floats_host[at : at + scores.numel()].tolist()
            at += scores.numel()
        outcomes = []
        for i, row in enumerate(rows):
            n = row.inp.block_len
            choices: list[tuple[int, float]] = []
            if picks_host is not None:
                choices = [
                    (int(picks_host[i][g][0]), picks_host[i][g][1]) for g in range(len(row.inp.groups))
                ]
            outcomes.append(RowOutcome(tokens_host[i, :n].tolist(), commit_host[i, :n].tolist(), choices))
        return outcomes

    def _restrict_ids(self, block_logits: Tensor, rows: list[RowSpec]) -> None:
        """Positions restricted to a set of ids: every other id gets -inf (in place). Only the
        restricted positions' [V] masks are stacked and copied ([N, V], not [R, Bmax, V])."""
        restricted = [
            (i, o, mask)
            for i, row in enumerate(rows)
            for o, mask in enumerate(row.inp.allowed_ids)
            if mask is not None
        ]
        if not restricted:
            return
        dev = block_logits.device
        at_rows = torch.tensor([i for i, _, _ in restricted], device=dev)  # [N]
        at_offsets = torch.tensor([o for _, o, _ in restricted], device=dev)  # [N]
        allowed = torch.stack([mask for _, _, mask in restricted]).to(dev)  # [N, V]
        block_logits[at_rows, at_offsets] = block_logits[at_rows, at_offsets].masked_fill(
            ~allowed, float("-inf")
        )

    def _choose_sequences(
        self, block_logits: Tensor, rows: list[RowSpec], tokens: Tensor, confidence: Tensor, uniforms: Tensor
    ) -> tuple[Tensor | None, list[tuple[int, int, Tensor]]]:
        """Restricted slots: score each candidate by its summed log-probs over the slot's positions.

        A final group (the slot's last block) adds the scores its earlier blocks carried
        (``SlotGroup.prior``), normalises over the candidates, picks the argmax (or draws at
        temperature > 0), and writes the pick's tokens and its normalised probability as the
        confidence of its positions (in place). A deferred group (not the slot's last block) is
        only scored: its per-candidate sums are returned as ``(row, group, [C] scores)`` and the
        caller writes them to ``SlotGroup.scores`` after the pass's one host copy; its pick stays
        (0, 0.0). A ``scored`` final group (a constrained slot) is picked as any final group and
        its scores (prior included) are returned too: the host makes the choice over the allowed
        combinations (``SequenceState._record_groups``).

        Returns ([R, G, 2] (candidate index, normalised probability) or None without slots, the
        deferred and scored groups' scores).
        """
        num_groups = max((len(row.inp.groups) for row in rows), default=0)
        if num_groups == 0:
            return None, []
        picks = torch.zeros(len(rows), num_groups, 2, dtype=torch.float64, device=block_logits.device)
        scored: list[tuple[int, int, Tensor]] = []  # (row, group, [C] scores): deferred and scored groups
        for i, row in enumerate(rows):
            if not row.inp.groups:
                continue
            logp = torch.log_softmax(block_logits[i].float(), dim=-1)  # [Bmax, V]
            for g, group in enumerate(row.inp.groups):
                offs = torch.tensor(group.offsets, device=logp.device)  # [n]
                cands = torch.tensor(group.candidates, device=logp.device)  # [C, n]
                scores = logp[offs[None, :], cands].sum(dim=-1)  # [C]
                if not group.final:
                    scored.append((i, g, scores))
                    continue
                if group.prior is not None:
                    scores = scores + torch.tensor(group.prior, dtype=scores.dtype, device=scores.device)
                if group.scored:  # a constrained slot: the host picks over the allowed combinations
                    scored.append((i, g, scores))
                pick, prob = _pick_candidate(scores, row.temperature, uniforms[i, group.offsets[0]])
                tokens[i, offs] = cands[pick]
                confidence[i, offs] = prob.to(confidence.dtype)
                picks[i, g, 0] = pick.to(picks.dtype)
                picks[i, g, 1] = prob.to(picks.dtype)
        return picks, scored


def _pick_candidate(scores: Tensor, temperature: float, u: Tensor) -> tuple[Tensor, Tensor]:
    """The chosen candidate of a restricted slot and its probability among the candidates.

    scores: [C] summed log-probs. The distribution is softmax(scores); temperature 0 takes its
    argmax (so the probability is >= 1/C), otherwise ``u`` (uniform in [0, 1)) draws from
    softmax(scores / temperature). Returns 0-dim tensors (index, probability under softmax(scores)).
    """
    probs = torch.softmax(scores, dim=-1)  # [C]
    if temperature > 0:
        cdf = torch.softmax(scores / temperature, dim=-1).cumsum(0)
        pick = torch.searchsorted(cdf, (u * cdf[-1])[None], right=True).clamp(max=len(scores) - 1)[0]
    else:
        pick = probs.argmax()
    return pick, probs[pick]
