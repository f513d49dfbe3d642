"""Clover-35B-A3B-Preview: the Qwen3.5-MoE hybrid trunk run as a block-diffusion denoiser.

Same forward contract as the SDAR/LLaDA2 model (``block_causal_model.py``; the skeleton both
share is ``decoder.py``), so the engine and the runner treat both alike: row ``b`` feeds ``T``
tokens, the first ``commit_lens[b]`` of which are committed (prefill, or the block resolved in
the previous pass) and the rest are the current block's rows, whose logits are returned (no
shift). What the rows mean differs, layer by layer:

- commit rows run the trunk's causal forward (token-causal attention over the committed K/V and
  each other; the gated delta rule in GDN layers), and their K/V, conv ring and state are kept;
- block rows run the preview: attention over everything committed plus the whole block
  (bidirectional), the GDN preview operator against the state just committed; nothing lasting.

Inside each layer the commit rows are processed before the block rows read the state, so the
engine may fuse the commit of block ``n`` with the first preview of block ``n + 1`` and the
outputs are those of separate passes. Without a cache every valid token is a commit row: the plain
causal forward that transformers' ``Qwen3_5MoeForCausalLM`` computes.
"""

from __future__ import annotations

import torch

from worker.model.attend import AttentionPlan
from worker.model.attention import CacheView, build_cache_view
from worker.model.config import ModelConfig
from worker.model.decoder import DecoderLayerBase, DecoderStack, build_feed_forward
from worker.model.gated_attention import GatedAttention
from worker.model.gated_deltanet import GatedDeltaNet, LinearStep
from worker.model.hybrid_cache import HybridCache
from worker.model.norm import OffsetRMSNorm


class HybridDecoderLayer(DecoderLayerBase):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attn_norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.linear = config.is_linear_layer(layer)
        self.mixer: GatedDeltaNet | GatedAttention
        if self.linear:
            self.mixer = GatedDeltaNet(config, config.linear_layers.index(layer))
        else:
            self.mixer = GatedAttention(config, config.attention_layers.index(layer))
        self.is_moe = config.is_moe_layer(layer)
        self.mlp = build_feed_forward(config, layer)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        view: CacheView | None,
        step: LinearStep,
        token_weight: torch.Tensor | None,
        counts_out: torch.Tensor | None,
    ) -> torch.Tensor:  # [B, T, H]
        h = self.input_norm(x)
        if isinstance(self.mixer, GatedDeltaNet):
            x = x + self.mixer(h, step)
        else:
            x = x + self.mixer(h, cos, sin, plan, view)
        return self.feed_forward(x, token_weight, counts_out)


class CloverHybridForBlockDiffusion(DecoderStack[HybridCache]):
    """Embedding, hybrid decoder layers, final norm, LM head (tied to the embedding or not); its
    committed state (``HybridCache``) is K/V for the attention layers, ring and state for the GDN
    layers."""

    cache_type = HybridCache

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, HybridDecoderLayer, OffsetRMSNorm)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T] absolute positions
        block_ids: torch.Tensor | None = None,  # unused: the rows' roles come from commit_lens
        *,
        valid: torch.Tensor | None = None,  # [B, T] bool, False = padding
        cache: HybridCache | None = None,
        slots: torch.Tensor | None = None,  # [B]
        commit_lens: torch.Tensor | None = None,  # [B] leading tokens to commit per row
        router_counts: torch.Tensor | None = None,  # [L, E] int64
        logits_index: torch.Tensor | None = None,  # [B, K] token indices to return logits for
    ) -> torch.Tensor:  # [B, T, V] float32 ([B, K, V] with logits_index)
        b, t = input_ids.shape
        dev = input_ids.device
        if valid is None:
            valid = torch.ones(b, t, dtype=torch.bool, device=dev)
        view, lengths, commit_list, count_list = build_cache_view(t, cache, slots, commit_lens, valid)
        counts = valid.sum(dim=1)  # [B]
        if cache is None:  # the plain causal forward: every valid token commits, nothing is kept
            commits, commit_list = counts, count_list
        else:
            commits = torch.zeros_like(counts) if commit_lens is None else commit_lens.to(dev, torch.long)
        step = self._linear_step(cache, slots, commits, counts, commit_list, count_list, t)

        # commit rows see earlier commit rows (token-causal); block rows see every row of the
        # forward (bidirectional block over all that is committed): one "block id" per token
        index = torch.arange(t, device=dev)[None, :]  # [1, T]
        ids = torch.where(index < commits[:, None], index, (counts - 1)[:, None])  # [B, T]
        # one row over a committed prefix: no mask over the prefix, and a commit-only chunk (a
        # prefill) is plain token-causal: no mask at all; else one dense bias (attend.py)
        single = view is not None and len(view.committed) == 1
        plan = self.attention_plan(ids, valid, lengths, view,
                                   causal=single and commit_list[0] == count_list[0] == t)
        token_weight = valid.reshape(-1).to(torch.float32)  # [B*T]
        x = self.run_layers(input_ids, positions, token_weight, router_counts, plan, view, step)
        if cache is not None and slots is not None and step.commit_tokens:
            cache.flip(slots.to(device=cache.device, dtype=torch.long))  # the new rings/states hold
        self.advance_cache(cache, view, commit_lens)
        return self.logits(x, logits_index)

    @staticmethod
    def _linear_step(
        cache: HybridCache | None,
        slots: torch.Tensor | None,
        commits: torch.Tensor,  # [B]
        counts: torch.Tensor,  # [B] valid tokens
        commit_list: list[int],
        count_list: list[int],
        t: int,
    ) -> LinearStep:
        dev = commits.device
        tc = max(commit_list, default=0)
        width = max((n - c for n, c in zip(count_list, commit_list, strict=True)), default=0)
        rows = counts - commits  # [B] block rows per row
        offsets = torch.arange(width, device=dev)[None, :]  # [1, P]
        preview_valid = offsets < rows[:, None]  # [B, P]
        preview_index = torch.where(preview_valid, commits[:, None] + offsets, t)  # [B, P]
        read_rows = write_rows = None
        if cache is not None and slots is not None:
            slots = slots.to(device=cache.device, dtype=torch.long)
            read_rows = cache.read_rows(slots)
            write_rows = cache.write_rows(slots) if tc else None
        return LinearStep(
            cache=cache,
            read_rows=read_rows,
            write_rows=write_rows,
            commit_lens=commits,
            commit_mask=torch.arange(tc, device=dev)[None, :] < commits[:, None],
            preview_index=preview_index,
            preview_rows=rows,
            preview_valid=preview_valid,
        )
