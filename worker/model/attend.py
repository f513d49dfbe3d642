"""How every attention layer of one forward masks and computes attention (issue 26, build 3).

Two plans, chosen once per forward by ``plan_attention`` and shared by every layer:

* **dense**: the general case (a batch of rows at different committed lengths, or no cache): one
  additive bias ``[B, 1, G*T, S]`` over every cache column (``mask.py``), with the ``G`` query
  heads of a KV head folded into the query axis.
* **split**: one row (``B = 1``) continuing a committed prefix of ``L`` positions: a chunk of a long
  prefill, a prefix-cache fill, or one sequence's pass. Its mask has a fixed structure: every
  query sees all ``L`` committed columns, and among its own ``T`` new columns what the
  block-causal rule allows (token-causal for a Clover commit, whole blocks for SDAR/LLaDA2, the
  bidirectional block for a preview). Nothing of size ``T x S`` is built:

  - on CPU, attention is computed in two parts, each a fused flash-attention call with no mask
    over the prompt: the prefix part (``L`` keys, no mask) and the new part (``T`` keys, causal or a
    ``[1, 1, T, T]`` bias), each returning its log-sum-exp ``m``; they merge exactly:
    ``out = (e^m1 o1 + e^m2 o2) / (e^m1 + e^m2) = lerp(o2, o1, sigmoid(m1 - m2))`` (the softmax
    over a union of disjoint key sets), in float32;
  - on CUDA, a token-causal row is one call with a bottom-right-aligned causal bias
    (``causal_lower_right``), which the dispatcher runs on the flash or memory-efficient kernel
    without a mask; a block-causal row keeps the dense plan there (not measured on a GPU yet).

Memory per pass is then bounded by the chunk (queries, two outputs, a ``T x T`` bias), not by the
prompt: the prefix K/V are read in place from the cache. Exactness against the dense masked SDPA
(allclose: the merge rounds once more) is tested in ``tests/unit/test_model_attend.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.model.mask import block_causal_mask, cached_block_causal_mask, grouped_additive_bias

_FlashWithLse = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _cpu_flash_with_lse() -> _FlashWithLse | None:
    """The CPU flash-attention op that also returns the log-sum-exp (private to PyTorch; present
    since 2.2 and in the pinned 2.13). None when this torch lacks it: the dense plan is used."""
    try:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    except (AttributeError, RuntimeError):
        return None


_CPU_FLASH = _cpu_flash_with_lse()


@dataclass(frozen=True)
class AttentionPlan:
    """What every attention layer of one forward attends with (see the module docstring)."""

    dense: torch.Tensor | None  # [B, 1, G*T, S] additive bias; None = the split plan
    prefix: int = 0  # split: committed columns every query sees (the row's committed length)
    local: torch.Tensor | None = None  # split: [1, 1, T, T] additive bias over the new keys; None = causal


def plan_attention(
    block_ids: torch.Tensor,  # [B, T] block index per new token (the token index: token-causal)
    valid: torch.Tensor | None,  # [B, T] bool, False = padding
    *,
    groups: int,
    dtype: torch.dtype,
    lengths: torch.Tensor | None = None,  # [B] committed positions per row (with a cache)
    key_len: int = 0,  # S: cache columns a dense forward attends over
    prefix: int | None = None,  # the one row's committed length, on the host (a split candidate)
    causal: bool = False,  # the new tokens are exactly token-causal and all valid
) -> AttentionPlan:
    """The plan of one forward: split when one row continues a cache (``prefix`` given) and this
    device has a mask-free kernel for it, else the dense bias (``mask.py``)."""
    t = block_ids.shape[1]
    # over a committed prefix the CPU split merges two kernels' outputs by their log-sum-exp, which
    # the private op's backward treats as a constant: a forward that records gradients there
    # (training's chained passes, ``worker.training.chain``) takes the dense bias, whose gradient
    # is exact (measured: up to 80% of a layer's gradient off otherwise)
    merged = bool(prefix) and block_ids.device.type == "cpu" and torch.is_grad_enabled()
    if prefix is not None and not merged and block_ids.shape[0] == 1 and prefix + t <= key_len:
        device = block_ids.device
        if causal and (device.type == "cuda" or (device.type == "cpu" and _CPU_FLASH is not None)):
            return AttentionPlan(dense=None, prefix=prefix, local=None)
        if device.type == "cpu" and _CPU_FLASH is not None:
            local = grouped_additive_bias(block_causal_mask(block_ids, valid), 1, dtype)  # [1, 1, T, T]
            return AttentionPlan(dense=None, prefix=prefix, local=local)
    if lengths is None:
        mask = block_causal_mask(block_ids, valid)  # [B, 1, T, T]
    else:
        mask = cached_block_causal_mask(block_ids, valid, lengths, key_len)  # [B, 1, T, S]
    return AttentionPlan(dense=grouped_additive_bias(mask, groups, dtype))  # [B, 1, G*T, S]


def attend(
    q: torch.Tensor,  # [B, H, T, D]
    keys: torch.Tensor,  # [B, KVH, S, D] (S >= prefix + T under the split plan)
    values: torch.Tensor,  # [B, KVH, S, D]
    plan: AttentionPlan,
) -> torch.Tensor:  # [B, H, T, D]
    """Scaled dot-product attention of ``q`` over ``keys``/``values`` under ``plan``; query head
    ``h`` reads KV head ``h // G`` (``G = H / KVH``), as the dense plan's head folding does."""
    b, h, t, d = q.shape
    kvh = keys.shape[1]
    if plan.dense is not None:
        # fold the G query heads of each KV head into the query axis: no K/V repeat
        folded = q.reshape(b, kvh, (h // kvh) * t, d)  # [B, KVH, G*T, D]
        return F.scaled_dot_product_attention(folded, keys, values, attn_mask=plan.dense).view(b, h, t, d)
    n = plan.prefix
    if q.device.type != "cpu":  # CUDA, token-causal: bottom-right-aligned causal, no mask
        from torch.nn.attention.bias import causal_lower_right  # deferred: imports torch._dynamo (+70 MB)

        return F.scaled_dot_product_attention(q, keys[:, :, : n + t], values[:, :, : n + t],
                                              attn_mask=causal_lower_right(t, n + t), enable_gqa=True)
    assert _CPU_FLASH is not None  # plan_attention splits on CPU only with it
    # the new part: T x T, upper-left causal (= token-causal) or the block-causal bias
    out_new, lse_new = _CPU_FLASH(q, keys[:, :, n : n + t], values[:, :, n : n + t], 0.0,
                                  plan.local is None, attn_mask=plan.local)  # [B, H, T, D], [B, H, T]
    if n == 0:
        return out_new
    out_pre, lse_pre = _CPU_FLASH(q, keys[:, :, :n], values[:, :, :n], 0.0, False)
    weight = torch.sigmoid(lse_pre - lse_new)[..., None]  # [B, H, T, 1] the prefix's share of the softmax
    return torch.lerp(out_new.float(), out_pre.float(), weight).to(q.dtype)  # [B, H, T, D]
