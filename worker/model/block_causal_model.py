"""The all-attention MoE decoder run as a block-diffusion denoiser: SDAR-MoE (Qwen3-MoE) and
LLaDA2-MoE (BailingMoeV2: its router, shared experts and partial RoPE come from the config).

One forward runs ``T`` new positions per row against the row's committed KV cache under the
block-causal mask, returns float32 logits for every new position (logits at ``p`` predict the
token at ``p``: no shift) and optionally appends the first ``commit_lens[b]`` new positions of
each row to its cache slot. Parameter names are our own; ``checkpoint.py`` maps Hugging Face
names onto them at load time.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.model.attend import AttentionPlan, plan_attention
from worker.model.attention import Attention, CacheView, build_cache_view
from worker.model.config import ModelConfig
from worker.model.kv_cache import KVCache
from worker.model.moe import DenseMLP, SharedExpertMoE, SparseMoE
from worker.model.norm import RMSNorm
from worker.model.rope import rope_cos_sin


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.is_moe = config.is_moe_layer(layer)
        self.mlp: SparseMoE | DenseMLP
        if not self.is_moe:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size)
        elif config.shared_expert_intermediate_size:
            self.mlp = SharedExpertMoE(config)
        else:
            self.mlp = SparseMoE(config)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        view: CacheView | None,
        token_weight: torch.Tensor | None,
        counts_out: torch.Tensor | None,
    ) -> torch.Tensor:  # [B, T, H]
        x = x + self.attn(self.input_norm(x), cos, sin, plan, view)
        h = self.post_attn_norm(x)
        if self.is_moe:
            return x + self.mlp(h, token_weight=token_weight, counts_out=counts_out)
        return x + self.mlp(h)


class BlockCausalForBlockDiffusion(nn.Module):
    """Embedding, decoder layers, final norm, LM head (tied to the embedding or not)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def new_cache(
        self, *, max_seqs: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> KVCache:
        """The committed-state cache this model reads and appends to (K/V of every layer)."""
        return KVCache(self.config, max_seqs=max_seqs, max_len=max_len, device=device, dtype=dtype)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T] absolute positions
        block_ids: torch.Tensor,  # [B, T] block index per new token
        *,
        valid: torch.Tensor | None = None,  # [B, T] bool, False = padding
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,  # [B]
        commit_lens: torch.Tensor | None = None,  # [B] new positions to append per row
        router_counts: torch.Tensor | None = None,  # [L, E] int64
        logits_index: torch.Tensor | None = None,  # [B, K] new-token indices to return logits for
    ) -> torch.Tensor:  # [B, T, V] float32 ([B, K, V] with logits_index)
        view, lengths, _, _ = build_cache_view(input_ids.shape[1], cache, slots, commit_lens, valid)
        # one row over a committed prefix (a prefill chunk, one sequence's pass): no mask over the
        # prefix; else one block-causal bias [B, 1, G*T, S] for every layer (attend.py)
        plan = plan_attention(
            block_ids,
            valid,
            groups=self.config.kv_groups,
            dtype=self.embed.weight.dtype,
            lengths=lengths,
            key_len=0 if view is None else view.key_len,
            prefix=view.committed[0] if view is not None and len(view.committed) == 1 else None,
        )
        x = self.embed(input_ids)  # [B, T, H]
        cos, sin = rope_cos_sin(positions, self.config.rotary_dim, self.config.rope_theta, x.dtype)
        token_weight = valid.reshape(-1).to(torch.float32) if valid is not None else None  # [B*T]
        for i, layer in enumerate(self.layers):
            counts = router_counts[i] if router_counts is not None else None
            x = layer(x, cos, sin, plan, view, token_weight, counts)
        if view is not None and cache is not None and commit_lens is not None:  # a view has a cache
            cache.lengths.index_add_(0, view.slots, commit_lens.to(cache.lengths))  # K/V already stored
        if logits_index is not None:  # e.g. only the block being denoised, not a long prefill
            x = x.gather(1, logits_index[..., None].expand(-1, -1, x.shape[-1]))  # [B, K, H]
        return self.lm_head(self.norm(x)).float()
