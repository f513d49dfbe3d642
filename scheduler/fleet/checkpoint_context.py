"""What a checkpoint's ``config.json`` says about long sequences, read without torch (issue 26).

The API validates a prompt against the served checkpoint at submit time, so it must know the
checkpoint's context (``max_position_embeddings``: Clover and the Qwen3.5-MoE layouts nest it
under ``text_config``) and what one sequence holds (K/V of the attention layers, the fixed Gated
DeltaNet state). It reads them here from the same folder it reads ``tokenizer.json`` from
(``api/prompt_tokens.py``): the checkpoint on this machine (``CLOVERQ_MODEL_DIR``, the embedded
demo by default). The worker sizes its engine from the same function on the folder it loads
(``worker/resident_model.py``), so both sides compute one number.

This reads a handful of fields the worker's full parse (``worker.model.config.ModelConfig``)
also reads; ``tests/unit/test_context_limits.py`` holds the two equal on every family's demo
checkpoint and on Clover's published layout. Without a readable ``config.json`` the API knows
no checkpoint (``None``): its limits are the operator's settings alone, and a worker whose
checkpoint cannot hold a job fails that job (``invalid_input``) instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.fleet.sequence_memory import GDN_STATE_COPIES, SequenceMemory, gdn_state_bytes

# model_type values whose trunk is the Qwen3.5-MoE hybrid (worker.model.config: CLOVER_MODEL_TYPES
# | CAUSAL_TRUNK_MODEL_TYPES; the test above holds the sets equal)
HYBRID_MODEL_TYPES = frozenset({"clover_moe", "clover_moe_text", "qwen3_5_moe", "qwen3_5_moe_text"})
FULL_ATTENTION = "full_attention"
DEFAULT_CONTEXT = 32768  # a config naming no max_position_embeddings (ModelConfig's default)
# bytes of one element per dtype name as config.json or CLOVERQ_DTYPE spell it (float32 when none)
_ELEMENT_BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
                  "half": 2}


@dataclass(frozen=True)
class CheckpointContext:
    """The checkpoint's context length and what one of its sequences holds."""

    max_positions: int  # max_position_embeddings: positions the model reads (prompt + output)
    memory: SequenceMemory


def checkpoint_context(config: dict[str, Any], *, dtype: str | None = None) -> CheckpointContext:
    """The context of a parsed ``config.json``. ``dtype``: ``CLOVERQ_DTYPE`` when set (the cache
    holds K/V in the model's dtype: that, else the config's ``dtype``/``torch_dtype``, else
    float32, as ``worker.model.hf_defaults.resolve_dtype``)."""
    d = dict(config)
    if isinstance(d.get("text_config"), dict):  # a multimodal wrapper: the trunk is nested
        d = {**{k: v for k, v in d.items() if k != "text_config"}, **d["text_config"]}
    layers = int(d["num_hidden_layers"])
    heads = int(d["num_attention_heads"])
    hybrid = str(config.get("model_type", "")) in HYBRID_MODEL_TYPES
    kinds = list(d.get("layer_types") or ())
    if hybrid and not kinds:
        interval = int(d.get("full_attention_interval", 4))
        kinds = [FULL_ATTENTION if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    attention = layers if not hybrid else sum(kind == FULL_ATTENTION for kind in kinds)
    state = 0
    if hybrid:
        key_heads = int(d.get("linear_num_key_heads", 16))
        value_heads = int(d.get("linear_num_value_heads", 32))
        key_dim, value_dim = int(d.get("linear_key_head_dim", 128)), int(d.get("linear_value_head_dim", 128))
        state = GDN_STATE_COPIES * gdn_state_bytes(
            layers=layers - attention, value_heads=value_heads, key_head_dim=key_dim,
            value_head_dim=value_dim, conv_channels=2 * key_heads * key_dim + value_heads * value_dim,
            conv_kernel=int(d.get("linear_conv_kernel_dim", 4)))
    memory = SequenceMemory(
        attention_layers=attention, kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
        kv_element_bytes=_element_bytes(dtype or d.get("dtype") or d.get("torch_dtype")), state_bytes=state)
    return CheckpointContext(int(d.get("max_position_embeddings", DEFAULT_CONTEXT)), memory)


def read_checkpoint_context(model_dir: Path, *, dtype: str | None = None) -> CheckpointContext | None:
    """The context of the checkpoint in ``model_dir``, or None when its ``config.json`` is missing
    or unreadable (then only the operator's limits apply)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
        return checkpoint_context(config, dtype=dtype)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def _element_bytes(name: Any) -> int:
    if name is None or name == "auto":
        return 4
    return _ELEMENT_BYTES.get(str(name).removeprefix("torch."), 4)
