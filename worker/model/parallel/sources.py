"""Where a rank's weights come from (``ShardSource``), and how every rank builds its shard from one.

A source is picklable: it travels to the spawned ranks in their ``RankSpec`` (``spawn.py``), and
each rank, rank 0 included, calls ``build_rank_shard`` with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from worker.model.checkpoint import weight_files
from worker.model.config import ModelConfig
from worker.model.parallel.plan import ShardPlan
from worker.model.parallel.quant import load_device
from worker.model.parallel.shard import Shard, build_shard, load_shard_weights
from worker.model.quant_rules import QuantMode


class ShardSource(Protocol):
    """Where a rank's weights come from (picklable: it travels to the spawned ranks)."""

    def build(self, config: ModelConfig, plan: ShardPlan, *, device: torch.device, dtype: torch.dtype,
              reduce: Callable[[torch.Tensor], None]) -> Shard: ...


@dataclass(frozen=True)
class CheckpointSource:
    """A checkpoint folder: each rank reads its slices of the memory-mapped safetensors."""

    path: str
    with_preview: bool = True

    def build(self, config: ModelConfig, plan: ShardPlan, *, device: torch.device, dtype: torch.dtype,
              reduce: Callable[[torch.Tensor], None]) -> Shard:
        shard = build_shard(config, plan, device=device, dtype=dtype, reduce=reduce)
        load_shard_weights(shard, weight_files(Path(self.path)), config, with_preview=self.with_preview)
        shard.model.eval()
        return shard


def all_reduce(tensor: torch.Tensor) -> None:
    """The sum a shard's hooks run across the group (one per mixer, one per feed-forward)."""
    dist.all_reduce(tensor)


def build_rank_shard(source: ShardSource, config: ModelConfig, plan: ShardPlan, *, device: torch.device,
                     dtype: torch.dtype, quant: QuantMode | None) -> Shard:
    """This rank's shard from ``source``: on ``device``, or on the host when ``quant`` is to be applied
    there (``quant.quantize_in_group``, once the group is up) before it moves to ``device``."""
    return source.build(config, plan, device=load_device(device, quant), dtype=dtype, reduce=all_reduce)
