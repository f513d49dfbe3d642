"""The decoder skeleton both block-diffusion models share.

``BlockCausalForBlockDiffusion`` (SDAR / LLaDA2, ``block_causal_model.py``) and
``CloverHybridForBlockDiffusion`` (``hybrid_model.py``) differ in their token mixers (attention
only, or Gated DeltaNet and gated attention), their norm, and in what the rows of a forward mean;
everything around that is here, once:

- ``DecoderStack``: embedding, the decoder layers, final norm and LM head (tied to the embedding
  or not); ``new_cache`` builds the model's ``cache_type``; ``run_layers`` embeds, computes RoPE
  and runs every layer with its router counts; ``advance_cache`` records the committed
  positions; ``logits`` gathers the asked-for positions and returns float32 logits;
- ``DecoderLayerBase``: the feed-forward half of a layer (post-mixer norm, then the dense MLP or
  the MoE, by layer, from ``build_feed_forward``) with its residual.

Parameter names (``embed``, ``layers.N.input_norm``, ``layers.N.post_attn_norm``,
``layers.N.mlp``, ``norm``, ``lm_head``) are what ``hf_names.py`` maps checkpoints onto.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from worker.model.attend import AttentionPlan, plan_attention
from worker.model.attention import CacheView
from worker.model.config import ModelConfig
from worker.model.kv_cache import KVCache
from worker.model.moe import DenseMLP, SharedExpertMoE, SparseMoE
from worker.model.rope import rope_cos_sin


def build_feed_forward(config: ModelConfig, layer: int) -> SparseMoE | DenseMLP:
    """Layer ``layer``'s feed-forward: a dense MLP, routed experts plus a shared expert, or routed
    experts alone."""
    if not config.is_moe_layer(layer):
        return DenseMLP(config.hidden_size, config.intermediate_size)
    if config.shared_expert_intermediate_size:
        return SharedExpertMoE(config)
    return SparseMoE(config)


class DecoderLayerBase(nn.Module):
    """A decoder layer's feed-forward half; a subclass builds ``post_attn_norm``, ``is_moe`` and
    ``mlp`` (``build_feed_forward``) and its own mixer, and calls ``feed_forward`` after it."""

    post_attn_norm: nn.Module
    is_moe: bool
    mlp: SparseMoE | DenseMLP

    def feed_forward(
        self,
        x: torch.Tensor,  # [B, T, H] the residual stream after the mixer
        token_weight: torch.Tensor | None,
        counts_out: torch.Tensor | None,
    ) -> torch.Tensor:  # [B, T, H]
        h = self.post_attn_norm(x)
        if self.is_moe:
            return x + self.mlp(h, token_weight=token_weight, counts_out=counts_out)
        return x + self.mlp(h)


CacheT = TypeVar("CacheT", bound=KVCache)


class DecoderStack(nn.Module, Generic[CacheT]):
    """Embedding, decoder layers, final norm, LM head (tied to the embedding or not); a subclass
    names the committed-state cache its forward reads and appends to (``cache_type``)."""

    cache_type: type[CacheT]

    def __init__(
        self,
        config: ModelConfig,
        layer: Callable[[ModelConfig, int], nn.Module],
        norm: Callable[[int, float], nn.Module],
    ) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = norm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def new_cache(
        self, *, max_seqs: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> CacheT:
        """The committed-state cache this model reads and appends to, ``max_seqs`` slots of
        ``max_len`` positions."""
        return self.cache_type(self.config, max_seqs=max_seqs, max_len=max_len, device=device, dtype=dtype)

    def run_layers(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T] absolute positions
        token_weight: torch.Tensor | None,  # [B*T] float32, 0 for padding
        router_counts: torch.Tensor | None,  # [L, E] int64
        *mixer_args: Any,  # what each layer's mixer reads besides x, cos, sin
    ) -> torch.Tensor:  # [B, T, H]
        """The hidden states after every layer: ``layer(x, cos, sin, *mixer_args, token_weight,
        router_counts[i])`` in turn."""
        x = self.embed(input_ids)  # [B, T, H]
        cos, sin = rope_cos_sin(positions, self.config.rotary_dim, self.config.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            counts = router_counts[i] if router_counts is not None else None
            x = layer(x, cos, sin, *mixer_args, token_weight, counts)
        return x

    def attention_plan(
        self,
        block_ids: torch.Tensor,  # [B, T] block index per new token
        valid: torch.Tensor | None,  # [B, T] bool, False = padding
        lengths: torch.Tensor | None,  # [B] committed positions per row
        view: CacheView | None,
        *,
        causal: bool = False,  # the new tokens are exactly token-causal (a commit-only chunk)
    ) -> AttentionPlan:
        """The forward's attention plan (``attend.py``): one row over a committed prefix (a prefill
        chunk, one sequence's pass) attends the prefix without a mask; else one dense bias."""
        return plan_attention(
            block_ids,
            valid,
            groups=self.config.kv_groups,
            dtype=self.embed.weight.dtype,
            lengths=lengths,
            key_len=0 if view is None else view.key_len,
            prefix=view.committed[0] if view is not None and len(view.committed) == 1 else None,
            causal=causal,
        )

    @staticmethod
    def advance_cache(
        cache: KVCache | None, view: CacheView | None, commit_lens: torch.Tensor | None
    ) -> None:
        """The committed lengths of the forward's slots grow by ``commit_lens`` (the layers stored
        the committed K/V already); nothing without a cache view."""
        if view is not None and commit_lens is not None:  # a view has a cache
            assert cache is not None
            cache.lengths.index_add_(0, view.slots, commit_lens.to(cache.lengths))

    def logits(self, x: torch.Tensor, logits_index: torch.Tensor | None) -> torch.Tensor:
        """float32 logits ``[B, T, V]`` of the hidden states, or ``[B, K, V]`` of the positions
        ``logits_index`` ``[B, K]`` names (e.g. only the block being denoised, not a long prefill)."""
        if logits_index is not None:
            x = x.gather(1, logits_index[..., None].expand(-1, -1, x.shape[-1]))  # [B, K, H]
        return self.lm_head(self.norm(x)).float()
