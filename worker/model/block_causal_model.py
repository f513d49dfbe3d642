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

from worker.model.attend import AttentionPlan
from worker.model.attention import Attention, CacheView, build_cache_view
from worker.model.config import ModelConfig
from worker.model.decoder import DecoderLayerBase, DecoderStack, build_feed_forward
from worker.model.kv_cache import KVCache
from worker.model.norm import RMSNorm


class DecoderLayer(DecoderLayerBase):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.is_moe = config.is_moe_layer(layer)
        self.mlp = build_feed_forward(config, layer)

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
        return self.feed_forward(x, token_weight, counts_out)


class BlockCausalForBlockDiffusion(DecoderStack[KVCache]):
    """Embedding, decoder layers, final norm, LM head (tied to the embedding or not); its
    committed state is the K/V of every layer (``KVCache``)."""

    cache_type = KVCache

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderLayer, RMSNorm)

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
        plan = self.attention_plan(block_ids, valid, lengths, view)  # a block-causal bias or split
        token_weight = valid.reshape(-1).to(torch.float32) if valid is not None else None  # [B*T]
        x = self.run_layers(input_ids, positions, token_weight, router_counts, plan, view)
        self.advance_cache(cache, view, commit_lens)  # K/V already stored
        return self.logits(x, logits_index)
