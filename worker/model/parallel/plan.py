"""Which slice of every weight one rank of a tensor-parallel model holds.

A ``ShardPlan`` fixes, for rank ``r`` of ``N``, the contiguous ranges of attention query heads,
K/V heads, GDN key and value heads, expert-MLP columns (or experts), shared-expert and dense-MLP
columns it owns. ``rank_config`` is the ``ModelConfig`` of that shard: the same model classes built
from it have exactly the shard's shapes (a rank's attention is a model with ``H / N`` heads), so
the layers' own code runs unchanged and only their outputs are summed across ranks.

Divisibility (checked here, with a message naming the field):

- query heads and GDN value heads split evenly (``H % N == 0``, ``Hv % N == 0``);
- K/V heads (and GDN key heads) either split evenly or, when there are fewer than ranks, are
  replicated as vLLM does: ``N % KVH == 0`` and each rank holds the one K/V head its query heads
  read (contiguous query-head ranges stay inside one K/V group, so this is consistent); GDN
  value head ``h`` reads key head ``h // (Hv / Hk)``, so contiguous value-head ranges read a
  contiguous key-head range;
- MLP widths (``moe_intermediate_size``, ``shared_expert_intermediate_size``,
  ``intermediate_size``) split evenly; with expert parallelism the expert count does instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from worker.model.config import ConfigError, ModelConfig

MoeMode = Literal["columns", "experts"]
MOE_MODES: tuple[str, ...] = ("columns", "experts")


class ShardError(ConfigError):
    """The model cannot be split this many ways."""


@dataclass(frozen=True)
class ShardPlan:
    """The slices rank ``rank`` of ``world`` holds (all ranges are half-open, in full-model units)."""

    rank: int
    world: int
    moe: MoeMode
    q_heads: range  # attention query heads
    kv_heads: range  # attention K/V heads (one replicated head when KVH < world)
    k_heads: range  # GDN key heads
    v_heads: range  # GDN value heads
    experts: range  # experts held (all of them unless moe == "experts")
    moe_cols: range  # columns of each held expert's intermediate width
    shared_cols: range  # shared expert intermediate columns
    dense_cols: range  # dense MLP intermediate columns


def _even(total: int, rank: int, world: int, what: str) -> range:
    if total % world:
        raise ShardError(f"{what}={total} does not split into {world} equal parts")
    part = total // world
    return range(rank * part, (rank + 1) * part)


def _heads(total: int, rank: int, world: int, what: str) -> range:
    """Even split, or one replicated head per rank when there are fewer heads than ranks."""
    if total >= world:
        return _even(total, rank, world, what)
    if world % total:
        raise ShardError(
            f"{what}={total} is fewer than {world} ranks and does not divide it (heads can be "
            "replicated only when the rank count is a multiple of the head count)"
        )
    h = rank // (world // total)
    return range(h, h + 1)


def make_plan(config: ModelConfig, rank: int, world: int, moe: MoeMode = "columns") -> ShardPlan:
    """The slices of rank ``rank`` of ``world``; raises ``ShardError`` if the shapes do not split."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1}")
    if moe not in MOE_MODES:
        raise ValueError(f"moe must be one of {MOE_MODES}, not {moe!r}")
    if config.family not in ("sdar", "clover"):
        # LLaDA2 (BailingMoeV2) is not a shape question: its checkpoint fuses q/k/v into one
        # ``attention.query_key_value`` tensor (split at load by ``hf_names._llada2_targets``), which
        # the rank loader (``parallel/shard.py``) cannot slice per head yet, and its grouped sigmoid
        # router with ``expert_bias`` has no sharded test. Refused here, by name, before any rank starts.
        raise ShardError(
            f"tensor parallelism covers the sdar and clover families, not {config.family}: the rank "
            "loader cannot yet slice a fused query_key_value tensor by head (LLaDA2's attention), so "
            "serve this checkpoint with CLOVERQ_TENSOR_PARALLEL=1"
        )
    if moe == "experts" and getattr(config, "router_type", "softmax") != "softmax":
        raise ShardError("expert parallelism is implemented for the softmax top-k router only")
    q = _even(config.num_attention_heads, rank, world, "num_attention_heads")
    kv = _heads(config.num_key_value_heads, rank, world, "num_key_value_heads")
    if range(q.start // config.kv_groups, (q.stop - 1) // config.kv_groups + 1) != kv:
        raise ShardError("query heads of a rank would read K/V heads it does not hold")
    k = v = range(0)
    if config.family == "clover":
        v = _even(config.linear_num_value_heads, rank, world, "linear_num_value_heads")
        k = _heads(config.linear_num_key_heads, rank, world, "linear_num_key_heads")
        repeat = config.linear_num_value_heads // config.linear_num_key_heads
        if range(v.start // repeat, (v.stop - 1) // repeat + 1) != k:
            raise ShardError("GDN value heads of a rank would read key heads it does not hold")
    experts = range(config.num_experts)
    moe_cols = range(config.moe_intermediate_size)
    if config.num_experts:
        if moe == "experts":
            experts = _even(config.num_experts, rank, world, "num_experts")
        else:
            moe_cols = _even(config.moe_intermediate_size, rank, world, "moe_intermediate_size")
    shared = _even(config.shared_expert_intermediate_size, rank, world, "shared_expert_intermediate_size")
    dense_layers = [n for n in range(config.num_hidden_layers) if not config.is_moe_layer(n)]
    dense = _even(config.intermediate_size, rank, world, "intermediate_size") if dense_layers else range(0)
    return ShardPlan(rank, world, moe, q, kv, k, v, experts, moe_cols, shared, dense)


def rank_config(config: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The config whose model has exactly this rank's shapes (router and vocabulary stay whole)."""
    if plan.world == 1:
        return config
    changes: dict[str, Any] = dict(  # int fields (mypy checks ``replace(**changes)`` against every field)
        num_attention_heads=len(plan.q_heads),
        num_key_value_heads=len(plan.kv_heads),
        moe_intermediate_size=len(plan.moe_cols),
        shared_expert_intermediate_size=len(plan.shared_cols),
    )
    if config.intermediate_size and len(plan.dense_cols):
        changes["intermediate_size"] = len(plan.dense_cols)
    if config.family == "clover":
        changes.update(linear_num_key_heads=len(plan.k_heads), linear_num_value_heads=len(plan.v_heads))
    return dataclasses.replace(config, **changes)


def gdn_channels(config: ModelConfig, plan: ShardPlan) -> list[tuple[int, int]]:
    """Rows of ``in_proj_qkv`` (and conv channels) of this rank: its q part, k part, v part."""
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    key_dim = config.linear_num_key_heads * dk
    k, v = plan.k_heads, plan.v_heads
    return [
        (k.start * dk, k.stop * dk),
        (key_dim + k.start * dk, key_dim + k.stop * dk),
        (2 * key_dim + v.start * dv, 2 * key_dim + v.stop * dv),
    ]
