"""The split attention plan (``worker/model/attend.py``, issue 26 build 3) against the masked SDPA
it replaces: one row over a committed prefix, token-causal (Clover's commit) and block-causal
(SDAR/LLaDA2), prefixes from none to several chunks, chunks of one block and more; then the whole
models, chunk by chunk, against the dense plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worker.model import attend as attend_module
from worker.model.attend import attend, plan_attention
from worker.model.checkpoint import load_checkpoint

H, KVH, D = 8, 2, 16  # 4 query heads per KV head


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_ids: torch.Tensor,
               prefix: int) -> torch.Tensor:
    """Masked SDPA in float32 over [prefix | new]: every query sees the prefix, new key j iff its
    block <= the query's: ``[1, H, T, D]``."""
    t = block_ids.shape[1]
    local = block_ids[0][None, :] <= block_ids[0][:, None]  # [T, T]
    mask = torch.cat((torch.ones(t, prefix, dtype=torch.bool), local), dim=1)  # [T, L+T]
    return F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=mask,
                                          enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [1, 4])  # 1: token-causal (Clover's commit); 4: block-causal
@pytest.mark.parametrize("prefix", [0, 4, 36, 300])
@pytest.mark.parametrize("blocks", [1, 3])  # chunk of one block, and of several
def test_split_plan_equals_masked_sdpa(dtype: torch.dtype, block: int, prefix: int, blocks: int) -> None:
    torch.manual_seed(prefix * 7 + blocks)
    t = block * blocks
    q = torch.randn(1, H, t, D, dtype=dtype)
    keys = torch.randn(1, KVH, prefix + t + 5, D, dtype=dtype)  # 5 stale columns past the new ones
    values = torch.randn(1, KVH, prefix + t + 5, D, dtype=dtype)
    positions = prefix + torch.arange(t)[None, :]  # [1, T]
    block_ids = positions // block
    with torch.no_grad():  # as the models' forwards plan (a forward recording gradients: below)
        plan = plan_attention(block_ids, None, groups=H // KVH, dtype=dtype, lengths=torch.tensor([prefix]),
                              key_len=prefix + t + 5, prefix=prefix, causal=block == 1)
    assert plan.dense is None and plan.prefix == prefix  # the split plan, no [T, S] mask
    assert plan.local is None if block == 1 else plan.local is not None and plan.local.shape == (1, 1, t, t)
    dense = plan_attention(block_ids, None, groups=H // KVH, dtype=dtype, lengths=torch.tensor([prefix]),
                           key_len=prefix + t + 5)  # the masked path of every other forward
    assert dense.dense is not None and dense.dense.shape == (1, 1, (H // KVH) * t, prefix + t + 5)
    split_out = attend(q, keys, values, plan)
    dense_out = attend(q, keys, values, dense)
    reference = _reference(q, keys[:, :, : prefix + t], values[:, :, : prefix + t], block_ids, prefix)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert split_out.shape == dense_out.shape == (1, H, t, D) and split_out.dtype == dtype
    torch.testing.assert_close(split_out.float(), reference, atol=tol, rtol=tol)
    torch.testing.assert_close(dense_out.float(), reference, atol=tol, rtol=tol)


@pytest.mark.parametrize("block", [1, 4])
def test_a_forward_with_gradients_over_a_prefix_attends_densely_for_the_exact_gradient(block: int) -> None:
    """On CPU the split merges the prefix's and the new part's outputs by their log-sum-exp, which
    the private flash op's backward holds constant, so its gradient is off; a forward with
    gradients over a committed prefix (training's chained passes) gets the dense plan instead,
    whose gradient is the masked SDPA's. Without a prefix the split is one kernel and stays."""
    torch.manual_seed(block)
    prefix, t = 36, 2 * block
    q = torch.randn(1, H, t, D, requires_grad=True)
    keys = torch.randn(1, KVH, prefix + t, D, requires_grad=True)
    values = torch.randn(1, KVH, prefix + t, D)
    block_ids = (prefix + torch.arange(t)[None, :]) // block
    args = {"groups": H // KVH, "dtype": torch.float32, "key_len": prefix + t, "causal": block == 1}
    plan = plan_attention(block_ids, None, lengths=torch.tensor([prefix]), prefix=prefix, **args)
    assert plan.dense is not None
    assert plan_attention(block_ids - prefix // block, None, prefix=0, **args).dense is None
    weight = torch.randn(1, H, t, D)
    (attend(q, keys, values, plan) * weight).sum().backward()
    got = (q.grad.clone(), keys.grad.clone())
    q.grad = keys.grad = None
    (_reference(q, keys, values, block_ids, prefix) * weight).sum().backward()
    torch.testing.assert_close(got, (q.grad, keys.grad), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        split = plan_attention(block_ids, None, lengths=torch.tensor([prefix]), prefix=prefix, **args)
    if attend_module._CPU_FLASH is not None:  # the plan serving takes, whose gradient this avoids
        assert split.dense is None
        q.grad = keys.grad = None
        (attend(q, keys, values, split) * weight).sum().backward()
        assert not torch.allclose(q.grad, got[0], atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA plan needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix", [0, 36, 300])
def test_cuda_token_causal_plan_equals_masked_sdpa(dtype: torch.dtype, prefix: int) -> None:
    """On CUDA a token-causal row is one bottom-right-aligned causal call; block-causal stays dense."""
    torch.manual_seed(prefix)
    t, dev = 64, torch.device("cuda")
    q = torch.randn(1, H, t, D, dtype=dtype, device=dev)
    keys = torch.randn(1, KVH, prefix + t + 8, D, dtype=dtype, device=dev)  # 8 aligned columns past
    values = torch.randn(1, KVH, prefix + t + 8, D, dtype=dtype, device=dev)
    positions = prefix + torch.arange(t, device=dev)[None, :]
    lengths = torch.tensor([prefix], device=dev)
    plan = plan_attention(positions, None, groups=H // KVH, dtype=dtype, lengths=lengths,
                          key_len=prefix + t + 8, prefix=prefix, causal=True)
    assert plan.dense is None and plan.local is None
    blocks = plan_attention(positions // 4, None, groups=H // KVH, dtype=dtype, lengths=lengths,
                            key_len=prefix + t + 8, prefix=prefix)
    assert blocks.dense is not None
    reference = _reference(q.cpu(), keys[:, :, : prefix + t].cpu(), values[:, :, : prefix + t].cpu(),
                           positions.cpu(), prefix)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(attend(q, keys, values, plan).float().cpu(), reference, atol=tol, rtol=tol)


def test_padding_and_several_rows_keep_the_dense_plan() -> None:
    ids = torch.arange(8)[None, :] // 4
    two_rows = plan_attention(ids.expand(2, -1), None, groups=2, dtype=torch.float32,
                              lengths=torch.tensor([3, 9]), key_len=17)
    assert two_rows.dense is not None and two_rows.dense.shape == (2, 1, 16, 17)
    no_cache = plan_attention(ids, None, groups=2, dtype=torch.float32)
    assert no_cache.dense is not None and no_cache.dense.shape == (1, 1, 16, 8)
    # one row whose new columns would pass the attended width: dense (the split plan slices them)
    assert plan_attention(ids, None, groups=2, dtype=torch.float32, lengths=torch.tensor([12]), key_len=16,
                          prefix=12).dense is not None


def _chunked_logits(model: torch.nn.Module, prompt: list[int], chunk: int, block: int) -> list[torch.Tensor]:
    """The logits of every prompt position, committed chunk by chunk into one slot."""
    cache = model.new_cache(max_seqs=2, max_len=len(prompt) + 8, device="cpu", dtype=torch.float32)
    slots = torch.tensor([1])
    out = []
    for start in range(0, len(prompt), chunk):
        ids = torch.tensor([prompt[start : start + chunk]])  # [1, T]
        positions = start + torch.arange(ids.shape[1])[None, :]
        out.append(model(ids, positions, positions // block, cache=cache, slots=slots,
                         commit_lens=torch.tensor([ids.shape[1]])))
    return out


def test_models_prefill_the_same_with_the_split_plan(family_checkpoint: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt prefilled in chunks of 1 and 3 blocks: the same logits on the split plan (this CPU's
    flash kernel) as on the dense masked plan (the kernel switched off), on every family."""
    lm = load_checkpoint(family_checkpoint)
    block = lm.config.block_size
    assert block is not None
    prompt = [(17 * i + 3) % (lm.config.vocab_size - 1) for i in range(6 * block)]
    for chunk in (block, 3 * block):
        split = _chunked_logits(lm.model, prompt, chunk, block)
        with monkeypatch.context() as patch:
            patch.setattr(attend_module, "_CPU_FLASH", None)
            dense = _chunked_logits(lm.model, prompt, chunk, block)
        for a, b in zip(split, dense, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
