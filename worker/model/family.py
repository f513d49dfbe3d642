"""The model families and what differs between them, chosen once from the config.

``sdar``: Qwen3-MoE / SDAR-MoE, every layer attention under the block-causal mask
(``block_causal_model.BlockCausalForBlockDiffusion``, a ``KVCache``). ``llada2``: LLaDA2-MoE
(BailingMoeV2), the same all-attention block-diffusion model with its own router and shared
experts (same classes; the config selects the parts). ``clover``: the Qwen3.5-MoE hybrid trunk
with block-diffusion preview operators (``hybrid_model.CloverHybridForBlockDiffusion``, a
``HybridCache``). Both models are built on one skeleton (``decoder.py``) and expose the same
``forward`` and ``new_cache``, so nothing downstream branches on the family; what a request that
names nothing decodes with is decided here too.
"""

from __future__ import annotations

from typing import TypeAlias, TypedDict

from worker.model import clover_decided
from worker.model.block_causal_model import BlockCausalForBlockDiffusion
from worker.model.clover_decided import DecodingDefaults
from worker.model.config import ModelConfig
from worker.model.hybrid_model import CloverHybridForBlockDiffusion

DiffusionModel: TypeAlias = BlockCausalForBlockDiffusion | CloverHybridForBlockDiffusion


class _FamilyDecoding(TypedDict):
    """``DecodingDefaults`` less the block size."""

    steps_per_block: int | None
    strategy: str
    threshold: float


# SDAR-MoE's defaults (the reference script's: 4 steps per block, static, threshold 0.9)
SDAR_DEFAULT_BLOCK_SIZE = 4
SDAR_DEFAULTS: _FamilyDecoding = {"steps_per_block": 4, "strategy": "static", "threshold": 0.9}
# LLaDA2-MoE's (as dInfer and SGLang serve it): blocks of 32, dynamic at 0.95, up to one step per position
LLADA2_DEFAULT_BLOCK_SIZE = 32
LLADA2_DEFAULTS: _FamilyDecoding = {"steps_per_block": None, "strategy": "dynamic", "threshold": 0.95}


def build_model(config: ModelConfig) -> DiffusionModel:
    """The in-memory model of ``config``'s family (parameters uninitialised by the caller's mode)."""
    if config.family == "clover":
        return CloverHybridForBlockDiffusion(config)
    return BlockCausalForBlockDiffusion(config)


def decoding_defaults(config: ModelConfig) -> DecodingDefaults:
    """Block size, steps per block, strategy and threshold when config and request are silent."""
    if config.family == "clover":
        return clover_decided.decoding_defaults(config.block_size)
    if config.family == "llada2":
        return DecodingDefaults(block_size=config.block_size or LLADA2_DEFAULT_BLOCK_SIZE, **LLADA2_DEFAULTS)
    return DecodingDefaults(block_size=config.block_size or SDAR_DEFAULT_BLOCK_SIZE, **SDAR_DEFAULTS)
