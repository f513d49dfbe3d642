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
    confidence is the plain softmax probability of the argmax (after the filters).
    """
    scale = torch.where(params.temperature > 0, params.temperature, torch.ones_like(params.temperature))
    scaled = logits / scale[:, None, None]  # [R, T, V]
    if not params.any_filter:
        return scaled
    vocab = scaled.shape[-1]
    sorted_vals, sorted_idx = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [R, T, V]
    ranks = torch.arange(vocab, device=scaled.device)  # [V]
    k = torch.where(params.top_k > 0, params.top_k, torch.full_like(params.top_k, vocab))  # [R]
    remove_sorted = (ranks[None, None, :] >= k[:, None, None]).expand_as(sorted_vals)  # [R, T, V]
    probs_sorted = torch.softmax(sorted_vals.masked_fill(remove_sorted, float("-inf")), dim=-1)
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted  # [R, T, V] mass of better tokens
    uses_p = (params.top_p < 1.0)[:, None, None]  # rows without top-p keep their whole tail
    remove_sorted = remove_sorted | ((mass_before > params.top_p[:, None, None]) & uses_p)  # first stays
    remove = torch.zeros_like(remove_sorted).scatter(-1, sorted_idx, remove_sorted)
    return scaled.masked_fill(remove, float("-inf"))


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
        sampling = params.temperature > 0  # [R]
        if uniforms is None:
            raise ValueError("uniforms are required when a row samples (temperature > 0)")
        cdf = probs.cumsum(dim=-1)  # [R, T, V]
        target = (uniforms.to(cdf.dtype) * cdf[..., -1]).unsqueeze(-1)  # [R, T, 1]
        drawn = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [R, T]
        drawn = drawn.clamp(max=probs.shape[-1] - 1)
        tokens = torch.where(sampling[:, None], drawn, tokens)
    confidence = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [R, T]
    return tokens, confidence
