"""Context up to the checkpoint's limit (issue 26): what the API reads from ``config.json`` equals
what the worker builds, memory is one formula, and the effective limits are min(checkpoint, setting).

The API never imports the worker, so it reads the checkpoint's context with
``scheduler.fleet.checkpoint_context``; these tests hold it equal to the worker's own parse
(``ModelConfig``), its caches and its engine on every family's demo checkpoint and on Clover's
published layout (trunk under ``text_config``, attention in 1 of 4 layers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from scheduler.fleet.checkpoint_context import HYBRID_MODEL_TYPES, checkpoint_context, read_checkpoint_context
from scheduler.fleet.context_limits import ContextLimits
from scheduler.infra.settings import Settings
from worker.engine.engine import Engine, EngineConfig
from worker.model.checkpoint import load_checkpoint, read_config
from worker.model.config import CAUSAL_TRUNK_MODEL_TYPES, CLOVER_MODEL_TYPES, ModelConfig
from worker.model.demo import DEMO_CONTEXT
from worker.model.demo_trained import TRAINED_CLOVER_DEMO
from worker.model.hybrid_cache import HybridCache
from worker.model.kv_cache import KVCache
from worker.model.planner import PlanInput

# Clover-35B-A3B-Preview as published (CLOVER.md): the trunk nested under text_config, no layer_types
CLOVER = {"model_type": "clover_moe", "architectures": ["CloverMoeModelLM"], "text_config": {
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "full_attention_interval": 4,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "max_position_embeddings": 131072, "dtype": "bfloat16",
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _worker_side(config: ModelConfig, dtype: torch.dtype) -> tuple[int, int, int]:
    """(max positions, K/V bytes per position, fixed bytes per sequence) as the worker's caches say."""
    cache = HybridCache if config.family == "clover" else KVCache
    per_position, state = cache.bytes_per_position(config, dtype), cache.bytes_per_sequence(config)
    return config.max_position_embeddings, per_position, state


def _api_side(raw: dict[str, Any], dtype: str) -> tuple[int, int, int]:
    context = checkpoint_context(raw, dtype=dtype)
    return context.max_positions, int(context.memory.bytes_per_position()), context.memory.state_bytes


def test_the_hybrid_model_types_are_the_workers() -> None:
    assert HYBRID_MODEL_TYPES == CLOVER_MODEL_TYPES | CAUSAL_TRUNK_MODEL_TYPES


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_api_reads_what_the_worker_builds_on_every_family(family_checkpoint: Path, dtype: str) -> None:
    raw = json.loads((family_checkpoint / "config.json").read_text())
    config = read_config(family_checkpoint)
    assert _api_side(raw, dtype) == _worker_side(config, DTYPES[dtype])
    assert checkpoint_context(raw).max_positions == DEMO_CONTEXT == 131_072  # the demos carry Clover's
    # the engine counts the fixed state as positions of equal bytes: the API's count is the same
    lm = load_checkpoint(family_checkpoint, dtype=DTYPES[dtype])
    engine = Engine(lm.model, EngineConfig(max_batch=1, max_len=64), mask_token_id=lm.config.mask_token_id,
                    eos_token_ids=())
    assert engine.state_positions == checkpoint_context(raw, dtype=dtype).memory.state_positions()


def test_clovers_published_layout_one_attention_layer_in_four() -> None:
    config = ModelConfig.from_hf_dict(CLOVER)
    assert _api_side(CLOVER, "bfloat16") == _worker_side(config, torch.bfloat16)
    memory = checkpoint_context(CLOVER).memory  # the config's own dtype: bfloat16
    assert memory.attention_layers == 10 and memory.bytes_per_position() == 2 * 10 * 2 * 256 * 2  # 20 KiB
    assert memory.state_bytes == 2 * 30 * (32 * 128 * 128 * 4 + 3 * 8192 * 4)  # two copies, 30 GDN layers
    # one formula: the planner's per-sequence bytes are the API's
    plan = PlanInput(total_params=35e9, active_params=3e9, dtype="bf16", context=32768, batch=1,
                     layers=10, kv_heads=2, head_dim=256, attention_heads=16,
                     state_bytes_per_sequence=memory.state_bytes)
    assert plan.memory == memory
    assert plan.memory.sequence_bytes(32768) == 32768 * 20480 + memory.state_bytes


def test_the_shipped_demo_carries_clovers_context_and_a_missing_config_is_none(tmp_path: Path) -> None:
    context = read_checkpoint_context(TRAINED_CLOVER_DEMO)
    assert context is not None and context.max_positions == 131_072
    assert read_checkpoint_context(tmp_path) is None  # no config.json: the settings alone
    (tmp_path / "config.json").write_text("{not json")
    assert read_checkpoint_context(tmp_path) is None


def test_effective_limits_are_the_smaller_of_checkpoint_and_setting() -> None:
    clover = checkpoint_context(CLOVER)
    default = ContextLimits.resolve(Settings(), clover)
    assert default.prompt_tokens == 16_384 and not default.prompt_limited_by_checkpoint  # a 16K contract fits
    assert default.sequence_positions == Settings().resolved_engine_max_len
    wide = ContextLimits.resolve(Settings(max_prompt_tokens=500_000), clover)
    assert wide.prompt_tokens == 131_072 and wide.prompt_limited_by_checkpoint
    assert wide.sequence_positions == 131_072 and wide.sequence_limited_by_checkpoint  # never past it
    unknown = ContextLimits.resolve(Settings(max_prompt_tokens=500_000), None)
    assert unknown.prompt_tokens == 500_000 and unknown.memory is None and unknown.needed_bytes(10) is None
    # memory: a sequence's positions plus its state (as positions) against the engine's K/V budget
    settings = Settings(engine_max_tokens_in_flight=65_536, engine_max_len=131_072)
    limits = ContextLimits.resolve(settings, clover)
    state = clover.memory.state_positions()  # 126 MiB of GDN state = 6,432 positions of 20 KiB
    assert limits.fits_memory(65_536 - state) and not limits.fits_memory(65_536 - state + 1)
    assert limits.max_fitting_positions() == 65_536 - state
    assert limits.budget_bytes() == 65_536 * 20_480
