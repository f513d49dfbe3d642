"""Weight-only int8 / int4 quantization of one rank's shard (``CLOVERQ_WEIGHT_DTYPE`` with TP).

Each rank quantizes the shard it loaded, with the single-device rules (``quant_rules``,
``quantize.quantize_model``): the same matrices, the same int4 groups where they fit, and a
shard that is the same model as the single-device one's slice of it:

- column-parallel matrices (q/k/v, ``in_proj_qkv``/``in_proj_z``, gate/up, ``w_gate_up``) hold
  whole rows: their per-output-channel int8 scales and int4 groups are those of one device;
- row-parallel matrices (``o_proj``, ``out_proj``, ``down_proj``, ``w_down`` split by columns)
  hold ``K / N`` inputs of every row. int8 takes each row's scale from the *whole* row: every rank
  computes its rows' max magnitudes and one all-reduce (MAX) of all of them, before any forward,
  gives each the whole rows' (so the codes and scales are exactly one device's, and TP=N logits
  differ from TP=1's by float rounding only). int4 groups run along the shard's own inputs: where
  the group divides ``K / N`` they are exactly one device's (a shard boundary is a group
  boundary); where it does not, the rank falls back as ``quant_rules.int4_group`` does, to the
  largest smaller group dividing ``K / N`` or to int8, and logs it (once per shape).

The shard is loaded on the host and quantized there, then moved to its device, as
``loader.load_model`` does: the full-precision shard never has to fit on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from worker.model.parallel.shard import Shard
from worker.model.quant_rules import QuantMode, int4_group
from worker.model.quantize import QuantReport, quantize_model, row_amax

log = logging.getLogger(__name__)

ROW_PARALLEL_LINEARS = frozenset({"o_proj", "out_proj", "down_proj"})  # input dim split across ranks


def row_parallel_int8(shard: Shard, mode: QuantMode) -> dict[str, tuple[int, int]]:
    """Matrices of ``shard`` that are row-parallel *and* held in int8 -> their (out, shard in)
    widths, in module order (the same on every rank). Logs the int4 group fallbacks."""
    plan = shard.plan
    found: dict[str, tuple[int, int]] = {}
    if plan.world == 1:
        return found
    fallbacks: dict[tuple[int, int | None, int | None], str] = {}
    for prefix, module in shard.model.named_modules():
        at = f"{prefix}." if prefix else ""
        for name, child in module.named_children():
            if type(child) is nn.Linear and name in ROW_PARALLEL_LINEARS:
                found[at + name] = (child.out_features, child.in_features)
        param = module._parameters.get("w_down")
        if param is not None and param.ndim == 3 and plan.moe == "columns":  # [E, I / N, H]
            found[at + "w_down"] = (param.shape[2], param.shape[1])
    for name, (_, k) in list(found.items()):
        if mode.kind != "int4":
            continue
        whole, here = int4_group(k * plan.world, mode.group_size), int4_group(k, mode.group_size)
        if here != whole:
            fallbacks.setdefault((k, whole, here), name)
        if here is not None:
            del found[name]  # int4 in groups of the shard's own inputs: no row-wide scale
    for (k, whole, here), name in fallbacks.items():
        log.warning(
            "rank %d: int4 group %s does not divide the shard's input width %d (e.g. %s, %d inputs on "
            "one device): %s here", plan.rank, whole, k, name, k * plan.world,
            f"group {here}" if here else "held in int8",
        )
    return found


def local_amax(shard: Shard, names: dict[str, tuple[int, int]]) -> torch.Tensor:
    """float32 max magnitude of every output row of ``names``' matrices over this shard's inputs, as
    one flat vector (one entry more, so that it is never empty)."""
    modules = dict(shard.model.named_modules())
    parts = [torch.zeros(1)]
    for name in names:
        owner, _, attr = name.rpartition(".")
        held = getattr(modules[owner], attr)
        w = held.weight if isinstance(held, nn.Linear) else held.transpose(1, 2)  # [.., N out, K in]
        parts.append(row_amax(w.detach()).float().reshape(-1).cpu())
    return torch.cat(parts)


def quantize_shard(
    shard: Shard,
    mode: QuantMode,
    *,
    device: torch.device | str | None = None,
    reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> QuantReport:
    """Quantize ``shard``'s model in place (then move it to ``device``).

    ``reduce_max(vector)`` returns the elementwise max of every rank's ``vector`` (the group's
    all-reduce); required with more than one rank. Every rank calls it exactly once.
    """
    names = row_parallel_int8(shard, mode)
    amaxes: dict[str, torch.Tensor] = {}
    if shard.plan.world > 1:
        if reduce_max is None:
            raise ValueError("a shard of a multi-rank plan needs reduce_max to quantize")
        whole = reduce_max(local_amax(shard, names))
        at = 1
        for name, (n, _) in names.items():
            owner, _, attr = name.rpartition(".")
            rows = n * (shard.model.get_submodule(owner).w_down.shape[0] if attr == "w_down" else 1)
            amax = whole[at : at + rows]
            amaxes[name] = amax.view(-1, n) if attr == "w_down" else amax
            at += rows
    return quantize_model(shard.model, mode, device=device, row_amax=amaxes)


def load_device(device: torch.device, quant: QuantMode | None) -> torch.device:
    """Where a rank loads its shard: the host when it is quantized there before moving."""
    return torch.device("cpu") if quant is not None else device


def quantize_in_group(shard: Shard, quant: QuantMode, device: torch.device) -> None:
    """Quantize a loaded shard on every rank alike (one all-reduce: row-parallel int8 scales); every
    rank of the group calls it once the group is up."""

    def reduce_max(vector: torch.Tensor) -> torch.Tensor:
        moved = vector.to(device)  # NCCL reduces device tensors
        dist.all_reduce(moved, op=dist.ReduceOp.MAX)
        return moved.cpu()

    report = quantize_shard(shard, quant, device=device, reduce_max=reduce_max)
    log.info("rank %d of %d: %s", shard.plan.rank, shard.plan.world, report)
