"""The two model families and what differs between them, chosen once from the config.

``sdar``: Qwen3-MoE / SDAR-MoE, every layer attention under the block-causal mask
(``model.CloverForBlockDiffusion``, a ``KVCache``). ``clover``: the Qwen3.5-MoE hybrid trunk with
block-diffusion preview operators (``hybrid_model.CloverHybridForBlockDiffusion``, a
``HybridCache``). Both expose the same ``forward`` and ``new_cache``, so nothing downstream
branches on the family; what a request that names nothing decodes with is decided here too.
"""

from __future__ import annotations

from typing import TypeAlias

from worker.model import clover_decided
from worker.model.clover_decided import DecodingDefaults
from worker.model.config import ModelConfig
from worker.model.hybrid_model import CloverHybridForBlockDiffusion
from worker.model.model import CloverForBlockDiffusion

DiffusionModel: TypeAlias = CloverForBlockDiffusion | CloverHybridForBlockDiffusion

# SDAR-MoE's defaults (the reference script's: 4 steps per block, static, threshold 0.9)
SDAR_DEFAULT_BLOCK_SIZE = 4
SDAR_DEFAULTS = dict(steps_per_block=4, strategy="static", threshold=0.9)


def build_model(config: ModelConfig) -> DiffusionModel:
    """The in-memory model of ``config``'s family (parameters uninitialised by the caller's mode)."""
    if config.family == "clover":
        return CloverHybridForBlockDiffusion(config)
    return CloverForBlockDiffusion(config)


def decoding_defaults(config: ModelConfig) -> DecodingDefaults:
    """Block size, steps per block, strategy and threshold when config and request are silent."""
    if config.family == "clover":
        return clover_decided.decoding_defaults(config.block_size)
    return DecodingDefaults(block_size=config.block_size or SDAR_DEFAULT_BLOCK_SIZE, **SDAR_DEFAULTS)
