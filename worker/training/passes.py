"""One denoising pass of the trained demo as the engine runs it, for the trainer and its own decode.

Plain torch over the model's forward (no engine; a fresh cache per pass, which ``denoise_kept``
hands back for the trainer's chained passes, ``worker.training.chain``): the trainer's loss
(``worker.training.trainer``) and the self-distillation stage's greedy decode
(``worker.training.self_distill``) both call it, so the pass they train and the pass they decode
with are one function (a ``cached_pool`` stage decodes with the model's cached forward instead:
the same pass, the prefix committed block by block).
"""

from __future__ import annotations

from typing import Any

import torch

from worker.model.hybrid_cache import HybridCache


def denoise(
    model: Any,
    ids: torch.Tensor,
    commit_lens: torch.Tensor,
    valid: torch.Tensor | None = None,
    logits_index: torch.Tensor | None = None,
) -> Any:
    """Logits ``[R, T, V]`` of one denoising pass as the engine runs it (with gradients): row
    ``r``'s first ``commit_lens[r]`` tokens are committed, the rest (up to ``valid``) the current
    block. Clover: commit rows then preview rows against a fresh cache; SDAR: block-causal mask.
    ``logits_index`` ``[R, K]``: only those positions' logits (``[R, K, V]``)."""
    if model.config.family != "clover":
        forward = type(model).forward.__wrapped__  # the forward without its no_grad
        r, t = ids.shape
        pos = torch.arange(t).expand(r, -1)
        extra = {} if logits_index is None else {"logits_index": logits_index}
        return forward(model, ids, pos, pos // model.config.block_size, valid=valid, **extra)
    return denoise_kept(model, ids, commit_lens, valid, logits_index)[0]


def denoise_kept(
    model: Any,
    ids: torch.Tensor,
    commit_lens: torch.Tensor,
    valid: torch.Tensor | None = None,
    logits_index: torch.Tensor | None = None,
    max_len: int | None = None,
) -> tuple[Any, HybridCache, torch.Tensor]:
    """A Clover model's ``denoise`` pass, with the cache it committed into and the rows' slots
    ``[R]`` (``worker.training.chain`` continues from them); ``max_len``: the cache's positions
    per row (at least ``T``; more for passes that follow)."""
    if model.config.family != "clover":
        raise ValueError(f"a cache of committed state is Clover's; this model is {model.config.family}")
    forward = type(model).forward.__wrapped__  # the forward without its no_grad
    r, t = ids.shape
    pos = torch.arange(t).expand(r, -1)
    cache = model.new_cache(max_seqs=r, max_len=max(t, max_len or t), device="cpu", dtype=torch.float32)
    slots = torch.tensor([cache.allocate() for _ in range(r)])
    extra = {} if logits_index is None else {"logits_index": logits_index}
    logits = forward(model, ids, pos, pos // model.config.block_size, valid=valid, cache=cache, slots=slots,
                     commit_lens=commit_lens, **extra)  # fmt: skip
    return logits, cache, slots
