"""The inference core: the model families (``family.py``: SDAR and LLaDA2 in
``block_causal_model.py`` with a ``KVCache``, Clover in ``hybrid_model.py`` with a ``HybridCache``,
both on the skeleton of ``decoder.py``), checkpoint loading (``checkpoint.py``, the Hugging Face
names in ``hf_names.py``) and the demo checkpoint. Plain torch: nothing here imports Celery, SQL
or HTTP.

The public names are resolved lazily (PEP 562) so that importing a torch-free submodule such as
``worker.model.manifest`` (the model store, the CLI) does not pay torch's multi-second import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.model.block_causal_model import BlockCausalForBlockDiffusion
    from worker.model.config import ConfigError, ModelConfig
    from worker.model.kv_cache import CacheFullError, KVCache

# Public name -> the submodule that defines it.
_LAZY_EXPORTS: dict[str, str] = {
    "CacheFullError": "worker.model.kv_cache",
    "BlockCausalForBlockDiffusion": "worker.model.block_causal_model",
    "ConfigError": "worker.model.config",
    "KVCache": "worker.model.kv_cache",
    "ModelConfig": "worker.model.config",
}

__all__ = [
    "BlockCausalForBlockDiffusion",
    "CacheFullError",
    "ConfigError",
    "KVCache",
    "ModelConfig",
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY_EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later look-ups skip this hook
    return value
