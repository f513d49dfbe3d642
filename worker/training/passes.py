"""One denoising pass of the trained demo as the engine runs it, for the trainer and its own decode.

Plain torch over the model's forward (no engine, no cache kept between passes): the trainer's loss
(``worker.training.trainer``) and the self-distillation stage's greedy decode
(``worker.training.self_distill``) both call it, so the pass they train and the pass they decode
with are one function.
"""

from __future__ import annotations

from typing import Any

import torch


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
    extra = {} if logits_index is None else {"logits_index": logits_index}
    forward = type(model).forward.__wrapped__  # the forward without its no_grad
    r, t = ids.shape
    pos = torch.arange(t).expand(r, -1)
    blocks = pos // model.config.block_size
    if model.config.family != "clover":
        return forward(model, ids, pos, blocks, valid=valid, **extra)
    cache = model.new_cache(max_seqs=r, max_len=t, device="cpu", dtype=torch.float32)
    slots = torch.tensor([cache.allocate() for _ in range(r)])
    return forward(model, ids, pos, blocks, valid=valid, cache=cache, slots=slots, commit_lens=commit_lens,
                   **extra)  # fmt: skip

