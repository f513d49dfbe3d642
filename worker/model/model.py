"""The Qwen3-MoE decoder run as a block-diffusion denoiser (SDAR-MoE).

One forward runs ``T`` new positions per row against the row's committed KV cache under the
block-causal mask, returns float32 logits for every new position (logits at ``p`` predict the
token at ``p``: no shift) and optionally appends the first ``commit_lens[b]`` new positions of
each row to its cache slot. Parameter names are our own; ``checkpoint.py`` maps Hugging Face
names onto them at load time.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.model.attention import Attention, CacheView
from worker.model.config import ModelConfig
from worker.model.kv_cache import CacheFullError, KVCache
from worker.model.mask import block_causal_mask, cached_block_causal_mask, grouped_additive_bias
from worker.model.moe import DenseMLP, SparseMoE
from worker.model.norm import RMSNorm
from worker.model.rope import rope_cos_sin


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.is_moe = config.is_moe_layer(layer)
        self.mlp: SparseMoE | DenseMLP = (
            SparseMoE(config) if self.is_moe else DenseMLP(config.hidden_size, config.intermediate_size)
        )

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        bias: torch.Tensor,
        view: CacheView | None,
        token_weight: torch.Tensor | None,
        counts_out: torch.Tensor | None,
    ) -> torch.Tensor:  # [B, T, H]
        x = x + self.attn(self.input_norm(x), cos, sin, bias, view)
        h = self.post_attn_norm(x)
        if self.is_moe:
            return x + self.mlp(h, token_weight=token_weight, counts_out=counts_out)
        return x + self.mlp(h)


class CloverForBlockDiffusion(nn.Module):
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
        view, lengths = self._cache_view(input_ids.shape[1], cache, slots, commit_lens, valid)
        if view is None:
            mask = block_causal_mask(block_ids, valid)  # [B, 1, T, T]
        else:
            mask = cached_block_causal_mask(block_ids, valid, lengths, view.key_len)  # [B, 1, T, S]
        bias = grouped_additive_bias(mask, self.config.kv_groups, self.embed.weight.dtype)  # [B, 1, G*T, S]
        x = self.embed(input_ids)  # [B, T, H]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        token_weight = valid.reshape(-1).to(torch.float32) if valid is not None else None  # [B*T]
        for i, layer in enumerate(self.layers):
            counts = router_counts[i] if router_counts is not None else None
            x = layer(x, cos, sin, bias, view, token_weight, counts)
        if view is not None and commit_lens is not None:
            cache.lengths.index_add_(0, view.slots, commit_lens.to(cache.lengths))  # K/V already stored
        if logits_index is not None:  # e.g. only the block being denoised, not a long prefill
            x = x.gather(1, logits_index[..., None].expand(-1, -1, x.shape[-1]))  # [B, K, H]
        return self.lm_head(self.norm(x)).float()

    def _cache_view(
        self,
        t: int,
        cache: KVCache | None,
        slots: torch.Tensor | None,
        commit_lens: torch.Tensor | None,
        valid: torch.Tensor | None,
    ) -> tuple[CacheView | None, torch.Tensor | None]:
        """Where each row's new K/V go and what it reads; one host sync for lengths and bounds."""
        if cache is None:
            if commit_lens is not None:
                raise ValueError("commit_lens needs a cache")
            return None, None
        if slots is None:
            raise ValueError("slots are required with a cache")
        slots = slots.to(device=cache.device, dtype=torch.long)
        lengths = cache.lengths[slots]  # [B]
        b = slots.shape[0]
        commits = torch.zeros_like(lengths) if commit_lens is None else commit_lens.to(lengths)
        host = torch.cat((slots, lengths, commits)).tolist()
        slot_list, len_list, commit_list = host[:b], host[b : 2 * b], host[2 * b :]
        if max(commit_list) > t:
            raise ValueError(f"commit_lens asks for {max(commit_list)} positions of a {t}-position forward")
        if max(n + c for n, c in zip(len_list, commit_list, strict=True)) > cache.max_len:
            raise CacheFullError(f"committing would pass the cache's {cache.max_len} positions per slot")
        start = slot_list[0]
        contiguous = slot_list == list(range(start, start + b))
        # on GPU rounded up to a multiple of 8 columns (masked) so attention kernels get aligned
        # rows; on CPU every extra column is only extra work
        align = 1 if cache.device.type == "cpu" else 8
        key_len = min(cache.max_len, -(-(max(len_list) + t) // align) * align)
        cols = torch.arange(t, device=cache.device)  # [T]
        pos = lengths[:, None] + cols[None, :]  # [B, T] destination columns
        rows = write_cols = None
        write_slots, write_pos = slots[:, None], pos
        if max(len_list) + t > cache.max_len:  # some positions have no room: padding may be skipped
            fits = pos < cache.max_len  # [B, T]
            if bool((~fits & (True if valid is None else valid)).any()):
                raise CacheFullError(f"a real new position would pass the cache's {cache.max_len} positions")
            rows, write_cols = fits.nonzero(as_tuple=True)  # [N], [N]
            write_slots, write_pos = slots[rows], pos[rows, write_cols]
        view = CacheView(
            cache=cache,
            slots=slots,
            key_len=key_len,
            slot_start=start if contiguous else None,
            write_slots=write_slots,
            write_pos=write_pos,
            write_rows=rows,
            write_cols=write_cols,
        )
        return view, lengths
