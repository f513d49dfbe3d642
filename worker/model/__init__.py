"""The inference core: the Qwen3-MoE / SDAR-MoE model under a block-causal mask, its KV cache,
checkpoint loading and the demo checkpoint. Plain torch: nothing here imports Celery, SQL or HTTP.
"""

from worker.model.config import ConfigError, ModelConfig
from worker.model.kv_cache import CacheFullError, KVCache
from worker.model.model import CloverForBlockDiffusion

__all__ = [
    "CacheFullError",
    "CloverForBlockDiffusion",
    "ConfigError",
    "KVCache",
    "ModelConfig",
]
