"""Token selection for masked positions: temperature, top-k, top-p, seeded draw, confidence.

Everything is batched over rows (sequences) and positions with per-row parameters, so one call
serves a whole engine pass. The random draw is inverse-CDF sampling from one uniform per
position; the uniforms come from each request's own ``torch.Generator`` (drawn by the caller),
which is what makes a seeded request give the same tokens alone or inside any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RowSampling:
    """Per-row sampling parameters as tensors on the logits' device (R rows)."""

    temperature: Tensor  # [R] float; 0 = greedy
    top_k: Tensor  # [R] long; 0 = no top-k
    top_p: Tensor  # [R] float; 1.0 = no top-p
    # host-side summaries (the engine knows them without a device sync); None: read the tensors
    filtering: bool | None = None  # any row uses top-k or top-p
    sampling: bool | None = None  # any row has temperature > 0
    # Where the caller knows them (None: every row / position goes through it), on the logits'
    # device: ``filter_at`` [N] long, the flattened (row * T + t) positions whose filtered
    # distribution is read (a filtering row's still-masked positions: the rest are never
    # committed, so their tokens and confidences are never used); ``sample_rows`` [S] long, the
    # rows that draw. Only the vocab-sized work shrinks: every value the caller reads is the same.
    filter_at: Tensor | None = None
    sample_rows: Tensor | None = None

    @property
    def any_filter(self) -> bool:
        if self.filtering is not None:
            return self.filtering
        return bool((self.top_k > 0).any() or (self.top_p < 1.0).any())

    @property
    def any_sampling(self) -> bool:
        if self.sampling is not None:
            return self.sampling
        return bool((self.temperature > 0).any())


def filter_logits(logits: Tensor, params: RowSampling) -> Tensor:
    """Tempered, top-k- and top-p-filtered logits (removed entries are -inf).

    logits: [R, T, V] float32. Greedy rows (temperature 0) are left unscaled so their
    confidence is the plain softmax probability of the argmax (after the filters). When no row
    samples and none filters, ``logits`` itself is returned (dividing by 1 is exact): callers
    must not write into the result. With ``params.filter_at`` only those positions are sorted
    and filtered; every other position keeps its tempered logits (its result is never read).
    """
    if params.any_sampling:
        scale = torch.where(params.temperature > 0, params.temperature, torch.ones_like(params.temperature))
        scaled = logits / scale[:, None, None]  # [R, T, V] (a fresh tensor)
    else:
        scaled = logits  # every scale is 1: x / 1 == x exactly, no vocab-sized copy
    if not params.any_filter:
        return scaled
    at = params.filter_at
    if at is None:
        return scaled.masked_fill(_removed(scaled, params.top_k, params.top_p), float("-inf"))
    t, vocab = scaled.shape[1], scaled.shape[2]
    flat = scaled.reshape(-1, vocab)  # [R*T, V] (a view: both are contiguous)
    sub = flat.index_select(0, at)[:, None, :]  # [N, 1, V]
    row = at // t  # [N] row of each position
    sub.masked_fill_(_removed(sub, params.top_k[row], params.top_p[row]), float("-inf"))
    if scaled is logits or flat.data_ptr() != scaled.data_ptr():
        return flat.index_copy(0, at, sub[:, 0]).view_as(scaled)  # never write into the caller's logits
    flat.index_copy_(0, at, sub[:, 0])
    return scaled


_RANKS: dict[tuple[int, torch.device], Tensor] = {}  # [V] 0..V-1 per (vocabulary, device)


def _ranks(vocab: int, device: torch.device) -> Tensor:
    """``arange(vocab)`` on ``device``, built once (a handful of vocabularies and devices)."""
    key = (vocab, device)
    ranks = _RANKS.get(key)
    if ranks is None:
        if len(_RANKS) >= 8:
            _RANKS.clear()
        ranks = _RANKS[key] = torch.arange(vocab, device=device)
    return ranks


def _removed(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """[R, T, V] bool: the entries top-k (``top_k`` [R], 0 = off) and top-p (``top_p`` [R],
    1.0 = off) remove from ``scaled`` [R, T, V]."""
    vocab = scaled.shape[-1]
    sorted_vals, sorted_idx = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [R, T, V]
    ranks = _ranks(vocab, scaled.device)  # [V]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))  # [R]
    remove_sorted = (ranks[None, None, :] >= k[:, None, None]).expand_as(sorted_vals)  # [R, T, V]
    probs_sorted = torch.softmax(sorted_vals.masked_fill(remove_sorted, float("-inf")), dim=-1)
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted  # [R, T, V] mass of better tokens
    uses_p = (top_p < 1.0)[:, None, None]  # rows without top-p keep their whole tail
    remove_sorted = remove_sorted | ((mass_before > top_p[:, None, None]) & uses_p)  # first stays
    return torch.zeros_like(remove_sorted).scatter(-1, sorted_idx, remove_sorted)


def select_tokens(logits: Tensor, params: RowSampling, uniforms: Tensor | None) -> tuple[Tensor, Tensor]:
    """Pick one token per position and its confidence.

    logits: [R, T, V]; uniforms: [R, T] in [0, 1) (needed when any row samples).
    Returns (tokens [R, T] long, confidence [R, T] float32): argmax for greedy rows (first index
    on ties), an inverse-CDF draw otherwise; confidence is the chosen token's probability under
    the tempered, filtered distribution.
    """
    filtered = filter_logits(logits, params)  # [R, T, V]
    probs = torch.softmax(filtered, dim=-1)  # [R, T, V]
    tokens = filtered.argmax(dim=-1)  # [R, T]
    if params.any_sampling:
        if uniforms is None:
            raise ValueError("uniforms are required when a row samples (temperature > 0)")
        rows = params.sample_rows
        if rows is None or rows.shape[0] == probs.shape[0]:
            sampling = params.temperature > 0  # [R]
            tokens = torch.where(sampling[:, None], _draw(probs, uniforms), tokens)
        else:  # only the sampling rows pay for the [S, T, V] cumulative sum
            drawn = _draw(probs.index_select(0, rows), uniforms.index_select(0, rows))  # [S, T]
            tokens = tokens.index_copy(0, rows, drawn)
    confidence = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [R, T]
    return tokens, confidence


def _draw(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Inverse-CDF draw: probs [N, T, V], uniforms [N, T] in [0, 1) -> [N, T] long."""
    cdf = probs.cumsum(dim=-1)  # [N, T, V]
    target = (uniforms.to(cdf.dtype) * cdf[..., -1]).unsqueeze(-1)  # [N, T, 1]
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [N, T]
    return drawn.clamp(max=probs.shape[-1] - 1)
