"""The model runner: turns the rows of one denoising pass into batched forwards and decisions.

It never decides policy (who runs, when a request ends): it receives each row's ``PassInput``
and returns, per row, the token chosen at every block position and which positions to commit.
All active rows go through one forward padded to the longest row; rows that carry a long
prefill are split into a second forward when padding them together would waste more than half
of the batch. Per-row sampling and commit rules run batched on the device; the host receives
one small copy per pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

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


class ModelRunner:
    """Owns the model and its KV cache; runs passes for the engine thread."""

    def __init__(self, model: DiffusionModel, cache: KVCache, *, mask_token_id: int) -> None:
        self.model = model
        self.cache = cache
        self.mask_token_id = mask_token_id
        self.device = cache.device
        cfg = model.config
        self.router_counts = torch.zeros(  # [L, E] tokens routed per layer and expert
            cfg.num_hidden_layers, max(cfg.num_experts, 1), dtype=torch.long, device=self.device
        )
        self._sync = self.device.type == "cuda"

    def run_pass(self, rows: list[RowSpec], timings: PassTimings) -> list[RowOutcome]:
        """One denoising pass for ``rows`` (one or two forwards); outcomes in row order. On an
        exception the rows' committed state (cache lengths, and GDN states of a hybrid cache) is
        as before the pass, so it can be re-run."""
        groups = self._split(rows)
        outcomes: dict[int, RowOutcome] = {}
        slots = torch.tensor([row.slot for row in rows], dtype=torch.long, device=self.device)  # [R]
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
        timings.forward_seconds += time.perf_counter() - began
        timings.forwards += 1

    @staticmethod
    def _split(rows: list[RowSpec]) -> list[list[int]]:
        """Rows with long prefill parts go to their own forward when padding would dominate."""
        lengths = [len(r.inp.tokens) for r in rows]
        short_limit = 2 * max(r.inp.block_len for r in rows)
        long_rows = [i for i, n in enumerate(lengths) if n > short_limit]
        short_rows = [i for i, n in enumerate(lengths) if n <= short_limit]
        if not long_rows or not short_rows:
            return [list(range(len(rows)))]
        padded_together = len(rows) * max(lengths)
        padded_apart = len(long_rows) * max(lengths) + len(short_rows) * short_limit
        return [long_rows, short_rows] if padded_apart * 2 < padded_together else [list(range(len(rows)))]

    def _run_group(self, rows: list[RowSpec], timings: PassTimings) -> list[RowOutcome]:
        r = len(rows)
        t = max(len(row.inp.tokens) for row in rows)
        bmax = max(row.inp.block_len for row in rows)
        dev = self.device

        # ---- host-side tensors (small, built from padded lists), one copy each to the device --
        mask_id = self.mask_token_id
        ids = torch.tensor([row.inp.tokens + [mask_id] * (t - len(row.inp.tokens)) for row in rows])  # [R, T]
        valid = (
            torch.arange(t)[None, :] < torch.tensor([len(row.inp.tokens) for row in rows])[:, None]
        )  # [R, T]
        masked = torch.tensor(
            [row.inp.masked + [False] * (bmax - row.inp.block_len) for row in rows]
        )  # [R, Bmax]
        group_ids = torch.tensor([row.inp.group_ids + [-1] * (bmax - row.inp.block_len) for row in rows])
        uniforms = torch.zeros(r, bmax)  # [R, Bmax]
        for i, row in enumerate(rows):
            if row.inp.uniforms is not None:
                uniforms[i, : row.inp.block_len] = row.inp.uniforms[: row.inp.block_len]
        start = torch.tensor([row.inp.start_pos for row in rows], dtype=torch.long)  # [R]
        commit_lens = torch.tensor([row.inp.commit_len for row in rows], dtype=torch.long)  # [R]
        block_size = torch.tensor([row.block_size for row in rows], dtype=torch.long)  # [R]
        positions = start[:, None] + torch.arange(t)[None, :]  # [R, T]
        block_ids = positions // block_size[:, None]  # [R, T]
        slots = torch.tensor([row.slot for row in rows], dtype=torch.long)  # [R]
        sampling = RowSampling(
            temperature=torch.tensor([row.temperature for row in rows], dtype=torch.float32, device=dev),
            top_k=torch.tensor([row.top_k for row in rows], dtype=torch.long, device=dev),
            top_p=torch.tensor([row.top_p for row in rows], dtype=torch.float32, device=dev),
            filtering=any(row.top_k > 0 or row.top_p < 1.0 for row in rows),
            sampling=any(row.temperature > 0 for row in rows),
        )
        quota = torch.tensor([row.inp.quota for row in rows], dtype=torch.long, device=dev)  # [R]
        threshold = torch.tensor([row.threshold for row in rows], dtype=torch.float32, device=dev)
        dynamic = torch.tensor([row.dynamic for row in rows], dtype=torch.bool, device=dev)  # [R]

        # ---- the forward: logits only for each row's current block ---------------------------
        offsets = (commit_lens[:, None] + torch.arange(bmax)[None, :]).clamp(max=t - 1)  # [R, Bmax]
        began = time.perf_counter()
        block_logits = self.model(
            ids.to(dev),
            positions.to(dev),
            block_ids.to(dev),
            valid=valid.to(dev),
            cache=self.cache,
            slots=slots.to(dev),
            commit_lens=commit_lens.to(dev),
            router_counts=self.router_counts if self.model.config.num_experts > 0 else None,
            logits_index=offsets.to(dev),
        )  # [R, Bmax, V]
        if self._sync:
            torch.cuda.synchronize(dev)
        timings.forward_seconds += time.perf_counter() - began
        timings.forwards += 1

        # ---- decisions ----------------------------------------------------------------------
        block_logits[..., self.mask_token_id] = float("-inf")  # never commit a mask token
        self._restrict_ids(block_logits, rows)
        masked = masked.to(dev)
        uniforms = uniforms.to(dev)
        tokens, confidence = select_tokens(block_logits, sampling, uniforms)  # [R, Bmax] x2
        group_picks = self._choose_sequences(block_logits, rows, tokens, confidence, uniforms)
        commit = choose_commits(confidence, masked, quota, threshold, dynamic)  # [R, Bmax]
        num_groups = max((len(row.inp.groups) for row in rows), default=0)
        if num_groups:
            commit = expand_to_groups(commit, group_ids.to(dev), num_groups)

        tokens_host = tokens.tolist()
        commit_host = commit.tolist()
        picks_host = group_picks.tolist() if group_picks is not None else None
        outcomes = []
        for i, row in enumerate(rows):
            n = row.inp.block_len
            choices: list[tuple[int, float]] = []
            if picks_host is not None:
                choices = [
                    (int(picks_host[i][g][0]), picks_host[i][g][1]) for g in range(len(row.inp.groups))
                ]
            outcomes.append(RowOutcome(tokens_host[i][:n], commit_host[i][:n], choices))
        return outcomes

    def _restrict_ids(self, block_logits: Tensor, rows: list[RowSpec]) -> None:
        """Positions restricted to a set of ids: every other id gets -inf (in place)."""
        restricted = [
            (i, o, mask)
            for i, row in enumerate(rows)
            for o, mask in enumerate(row.inp.allowed_ids)
            if mask is not None
        ]
        if not restricted:
            return
        allowed = torch.ones(block_logits.shape, dtype=torch.bool)  # [R, Bmax, V]
        for i, o, mask in restricted:
            allowed[i, o] = mask
        block_logits.masked_fill_(~allowed.to(block_logits.device), float("-inf"))

    def _choose_sequences(
        self, block_logits: Tensor, rows: list[RowSpec], tokens: Tensor, confidence: Tensor, uniforms: Tensor
    ) -> Tensor | None:
        """Restricted slots: score each candidate by its summed log-probs over the slot's positions.

        A final group (the slot's last block) adds the scores its earlier blocks carried
        (``SlotGroup.prior``), normalises over the candidates, picks the argmax (or draws at
        temperature > 0), and writes the pick's tokens and its normalised probability as the
        confidence of its positions (in place). A deferred group (not the slot's last block) is
        only scored: its per-candidate sums go to ``SlotGroup.scores`` (one host copy per pass
        for all of them), and its pick stays (0, 0.0).

        Returns [R, G, 2] (candidate index, normalised probability) or None without slots.
        """
        num_groups = max((len(row.inp.groups) for row in rows), default=0)
        if num_groups == 0:
            return None
        picks = torch.zeros(len(rows), num_groups, 2, dtype=torch.float64, device=block_logits.device)
        deferred: list[tuple[int, int, Tensor]] = []  # (row, group, [C] scores)
        for i, row in enumerate(rows):
            if not row.inp.groups:
                continue
            logp = torch.log_softmax(block_logits[i].float(), dim=-1)  # [Bmax, V]
            for g, group in enumerate(row.inp.groups):
                offs = torch.tensor(group.offsets, device=logp.device)  # [n]
                cands = torch.tensor(group.candidates, device=logp.device)  # [C, n]
                scores = logp[offs[None, :], cands].sum(dim=-1)  # [C]
                if not group.final:
                    deferred.append((i, g, scores))
                    continue
                if group.prior is not None:
                    scores = scores + torch.tensor(group.prior, dtype=scores.dtype, device=scores.device)
                pick, prob = _pick_candidate(scores, row.temperature, uniforms[i, group.offsets[0]])
                tokens[i, offs] = cands[pick]
                confidence[i, offs] = prob.to(confidence.dtype)
                picks[i, g, 0] = pick.to(picks.dtype)
                picks[i, g, 1] = prob.to(picks.dtype)
        if deferred:
            flat = torch.cat([scores for _, _, scores in deferred]).tolist()
            at = 0
            for i, g, scores in deferred:
                rows[i].inp.groups[g].scores = flat[at : at + scores.numel()]
                at += scores.numel()
        return picks


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
