"""One rank's shard of a model: built from ``rank_config``, filled from slices of the checkpoint.

The shard is the ordinary model class of the family built with the rank's head counts and MLP
widths (``plan.rank_config``), so every layer runs its own code on its slice. Two forward hooks
per decoder layer sum the partial outputs across ranks (one all-reduce after the mixer's
``o_proj``/``out_proj``, one after the feed-forward's down projections: routed experts and the
shared expert of a layer share that one all-reduce, as their sum is summed). Ranks other than 0
carry no LM head: only rank 0 samples, so they return empty logits ``[B, K, 0]``.

Weights come from the memory-mapped safetensors through ``safe_open(...).get_slice(name)[...]``:
a rank reads its rows/columns of every split tensor and nothing else (replicated tensors, i.e.
embedding, norms, routers, q/k norms, the GDN norm, whole). ``load_shard_weights`` returns the
number of elements it read, which the tests hold against the shard's parameter count.

FP8 block-scaled checkpoints (``fp8.py``): a rank reads its slice of the codes and only the rows
/ columns of ``weight_scale_inv`` that cover it (a shard boundary may fall inside a scale block:
element ``(i, j)`` of the slice takes block ``(abs_row // bn, abs_col // bk)``), and dequantizes
the slice, exactly as the single-device loader dequantizes the whole tensor.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from worker.model import fp8
from worker.model.checkpoint import CheckpointError, build_empty_model, mapped_tensors
from worker.model.config import ModelConfig
from worker.model.family import DiffusionModel
from worker.model.hf_names import PREVIEW_TENSORS, HfTarget, copy_into
from worker.model.moe import SharedExpertMoE, SparseMoE, _grouped_matmul
from worker.model.parallel.plan import ShardError, ShardPlan, gdn_channels, rank_config


@dataclass
class ReduceCounter:
    """All-reduces issued by the current forward (a fault before the first one is not fatal)."""

    count: int = 0


@dataclass
class Shard:
    """A rank's model plus the counter its all-reduce hooks bump."""

    model: DiffusionModel
    plan: ShardPlan
    counter: ReduceCounter = field(default_factory=ReduceCounter)


class _NoHead(nn.Module):
    """The LM head of ranks that do not sample: empty logits, no vocabulary matrix held."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., 0]
        return x.new_empty(*x.shape[:-1], 0)


class ExpertParallelMoE(SparseMoE):
    """Routed experts held ``E / N`` per rank: the router is whole (every rank routes every token
    alike), each rank runs only the token copies routed to its experts and the partial outputs
    are summed by the layer's all-reduce."""

    expert_offset: int = 0  # first expert held (set when a module is converted)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        *,
        token_weight: torch.Tensor | None = None,
        counts_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
        top_w, top_e = self._route_softmax(flat)  # [N, K] (make_plan refuses other routers)
        top_w = top_w.to(x.dtype)
        expert_of = top_e.reshape(-1)  # [N*K]
        order = torch.argsort(expert_of, stable=True)  # [N*K] copies sorted by expert
        counts = torch.bincount(expert_of, minlength=self.num_experts)  # [E]
        if counts_out is not None:
            self.add_expert_counts(counts_out, expert_of, counts, token_weight)
        held = self.w_gate_up.shape[0]
        lo = self.expert_offset
        ends = torch.cumsum(counts, 0)  # [E]
        first = int(ends[lo - 1]) if lo else 0  # one host sync: where this rank's copies lie
        last = int(ends[lo + held - 1])
        out = torch.zeros_like(flat)
        if last > first:
            mine = order[first:last]  # [M] sorted copies routed to held experts
            token_of = mine // self.top_k
            offsets = (ends[lo : lo + held] - first).to(torch.int32)  # [E/N]
            gate_up = _grouped_matmul(flat[token_of], self.w_gate_up, offsets)  # [M, 2I]
            gate, up = gate_up.chunk(2, dim=-1)
            ys = _grouped_matmul(F.silu(gate) * up, self.w_down, offsets)  # [M, H]
            out.index_add_(0, token_of, ys * top_w.reshape(-1)[mine, None])
        return out.view(shape)


class ExpertParallelSharedMoE(SharedExpertMoE, ExpertParallelMoE):
    """Qwen3.5's routed experts (expert parallel) plus its shared expert (column split)."""


def build_shard(
    config: ModelConfig,
    plan: ShardPlan,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    reduce: Callable[[torch.Tensor], None] | None = None,
) -> Shard:
    """Rank ``plan.rank``'s model with uninitialised weights and its all-reduce hooks.

    ``reduce`` sums a tensor across ranks in place (``dist.all_reduce``); required when
    ``plan.world > 1``.
    """
    model = build_empty_model(rank_config(config, plan), device=device, dtype=dtype)
    shard = Shard(model, plan)
    if plan.world == 1:
        return shard
    if reduce is None:
        raise ValueError("a shard of a multi-rank plan needs a reduce function")
    if plan.moe == "experts":
        for module in model.modules():
            if isinstance(module, SparseMoE):
                _to_expert_parallel(module, plan, device=device, dtype=dtype)
    if plan.rank > 0:
        model.lm_head = _NoHead()
    counter = shard.counter

    def summed(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        counter.count += 1
        reduce(output)
        return output

    for layer in model.layers:
        mixer = layer.attn if hasattr(layer, "attn") else layer.mixer
        mixer.register_forward_hook(summed)
        layer.mlp.register_forward_hook(summed)
    return shard


def _to_expert_parallel(module: SparseMoE, plan: ShardPlan, *, device: torch.device | str,
                        dtype: torch.dtype) -> None:
    held = len(plan.experts)
    _, h, two_i = module.w_gate_up.shape
    module.w_gate_up = nn.Parameter(torch.empty(held, h, two_i, device=device, dtype=dtype),
                                    requires_grad=False)
    module.w_down = nn.Parameter(torch.empty(held, two_i // 2, h, device=device, dtype=dtype),
                                 requires_grad=False)
    module.__class__ = ExpertParallelSharedMoE if isinstance(module, SharedExpertMoE) else ExpertParallelMoE
    module.expert_offset = plan.experts.start


# --- which slice of each checkpoint tensor a rank reads -------------------------------------------


@dataclass(frozen=True)
class Piece:
    """Read ``ranges`` of dimension ``dim`` (concatenated); ``dim`` None: the whole tensor."""

    dim: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()
    skip: bool = False  # not held by this rank (another rank's expert, the LM head of rank > 0)
    zero: bool = False  # held but zero here (a row-split layer's output bias lives on rank 0)


WHOLE = Piece()
SKIP = Piece(skip=True)
_LAYER = re.compile(r"layers\.(\d+)\.(attn|mixer|mlp)\.(.+)")
# GDN tensors with one row (or entry) per value head; the bd_* are the preview's per-head vectors
_GDN_HEADWISE = {"in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"} | (
    set(PREVIEW_TENSORS) - {"conv_right_weight"}
)


def _rng(r: range, unit: int = 1, offset: int = 0) -> tuple[int, int]:
    return (offset + r.start * unit, offset + r.stop * unit)


def piece_for(param: str, target: HfTarget, config: ModelConfig, plan: ShardPlan) -> Piece:
    """The slice of the checkpoint tensor behind ``target`` (our ``param``) this rank holds."""
    if param == "lm_head.weight":
        return SKIP if plan.rank > 0 else WHOLE
    match = _LAYER.fullmatch(param)
    if match is None or plan.world == 1:
        return WHOLE  # embedding, norms
    n, module, rest = int(match[1]), match[2], match[3]
    d = config.head_dim
    if module in ("attn", "mixer") and not config.is_linear_layer(n):
        q_rows = 2 * d if config.family == "clover" else d  # Clover's q_proj emits the gate too
        if rest.startswith("q_proj."):
            return Piece(0, (_rng(plan.q_heads, q_rows),))
        if rest.startswith(("k_proj.", "v_proj.")):
            return Piece(0, (_rng(plan.kv_heads, d),))
        if rest == "o_proj.weight":
            return Piece(1, (_rng(plan.q_heads, d),))
        if rest == "o_proj.bias":
            return Piece(zero=plan.rank > 0)
        if rest in ("q_norm.weight", "k_norm.weight"):
            return WHOLE
    elif module == "mixer":  # Gated DeltaNet
        dv = config.linear_value_head_dim
        if rest in ("in_proj_qkv.weight", "conv_weight", "conv_right_weight"):
            return Piece(0, tuple(gdn_channels(config, plan)))
        if rest == "in_proj_z.weight":
            return Piece(0, (_rng(plan.v_heads, dv),))
        if rest in _GDN_HEADWISE:
            return Piece(0, (_rng(plan.v_heads),))
        if rest == "out_proj.weight":
            return Piece(1, (_rng(plan.v_heads, dv),))
        if rest == "norm.weight":
            return WHOLE
    else:  # feed-forward
        if rest in ("router.weight", "shared_expert_gate.weight"):
            return WHOLE
        if rest in ("w_gate_up", "w_down"):
            return _expert_piece(target, config, plan)
        cols = plan.shared_cols if rest.startswith("shared_expert.") else plan.dense_cols
        leaf = rest.rsplit(".", 2)[-2]
        if leaf in ("gate_proj", "up_proj"):
            return Piece(0, (_rng(cols),))
        if leaf == "down_proj":
            return Piece(1, (_rng(cols),))
    raise ShardError(f"no tensor-parallel rule for parameter {param}")


def _expert_piece(target: HfTarget, config: ModelConfig, plan: ShardPlan) -> Piece:
    cols, experts, i = plan.moe_cols, plan.experts, config.moe_intermediate_size
    if target.part in ("gate", "up", "down"):  # one expert: [I, H] (gate/up) or [H, I] (down)
        if target.expert not in experts:
            return SKIP
        return Piece(0 if target.part != "down" else 1, (_rng(cols),))
    if plan.moe == "experts":  # fused [E, 2I, H] / [E, H, I]: this rank's experts
        return Piece(0, (_rng(experts),))
    if target.part == "gate_up_all":  # gate rows then up rows
        return Piece(1, (_rng(cols), _rng(cols, offset=i)))
    return Piece(2, (_rng(cols),))  # down_all


def read_piece(f: Any, name: str, piece: Piece) -> torch.Tensor:
    """The slice ``piece`` of tensor ``name`` of an open safetensors file (only those bytes read)."""
    if piece.dim is None:
        return f.get_tensor(name)
    view = f.get_slice(name)
    lead = (slice(None),) * piece.dim
    chunks = [view[(*lead, slice(a, b))] for a, b in piece.ranges]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=piece.dim)


def read_fp8_piece(
    f: Any,
    file: Path,
    name: str,
    piece: Piece,
    codes: torch.Tensor,
    found: dict[str, Path],
    block: tuple[int, int],
) -> torch.Tensor:
    """float32 slice ``piece`` of the FP8 tensor ``name`` of ``f`` (open ``file``) from its codes
    (``read_piece``'s) and the blocks of its ``weight_scale_inv`` that cover the slice (only those
    read; from another file of a sharded checkpoint when ``found`` says so)."""
    scale = fp8.scale_name(name)
    if scale not in found:
        raise CheckpointError(f"float8 tensor {name} has no {scale} (block scales)")
    shape = tuple(f.get_slice(name).get_shape())
    nd = len(shape)
    if nd < 2:
        raise CheckpointError(f"float8 tensor {name} has shape {list(shape)}: block scales need 2 dims")
    bn, bk = block
    expected = (*shape[:-2], -(-shape[-2] // bn), -(-shape[-1] // bk))
    with contextlib.ExitStack() as stack:
        other = f if found[scale] == file else stack.enter_context(
            safe_open(str(found[scale]), framework="pt", device="cpu"))
        view = other.get_slice(scale)
        if tuple(view.get_shape()) != expected:
            raise CheckpointError(f"tensor {name}: scale shape {list(view.get_shape())} does not match "
                                  f"weight {list(shape)} in blocks of {bn}x{bk} (expected {list(expected)})")
        if piece.dim is None:
            return _dequantize_at(codes, other.get_tensor(scale), block, 0, 0)
        d, bs = piece.dim, (bn if piece.dim == nd - 2 else bk)
        lead = (slice(None),) * d
        chunks, at = [], 0
        for a, b in piece.ranges:
            part = codes.narrow(d, at, b - a)
            at += b - a
            if d < nd - 2:  # a dim before the blocked two (the experts of a fused stack)
                chunks.append(_dequantize_at(part, view[(*lead, slice(a, b))], block, 0, 0))
                continue
            blocks = view[(*lead, slice(a // bs, -(-b // bs)))]
            row0, col0 = (a, 0) if d == nd - 2 else (0, a)
            chunks.append(_dequantize_at(part, blocks, block, row0, col0))
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=d)


def _dequantize_at(
    codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], row0: int, col0: int
) -> torch.Tensor:
    """float32 ``codes`` ``[..., n, k]`` whose element ``(0, 0)`` is ``(row0, col0)`` of the whole
    matrix, times ``scale``, the scale blocks from ``(row0 // bn, col0 // bk)`` on."""
    n, k = codes.shape[-2:]
    bn, bk = block
    rows = torch.arange(row0, row0 + n) // bn - row0 // bn  # [n] block row of each row
    cols = torch.arange(col0, col0 + k) // bk - col0 // bk  # [k]
    return codes.float() * scale.float()[..., rows[:, None], cols[None, :]]


def load_shard_weights(
    shard: Shard, files: list[Path], config: ModelConfig, *, with_preview: bool = True
) -> int:
    """Fill ``shard`` from its slices of ``files``; returns the number of elements read.

    The walk and its checks are ``load_weights``' (``checkpoint.mapped_tensors``): missing,
    unexpected and misshaped tensors are reported by name alike.
    """
    model, plan = shard.model, shard.plan
    walk = mapped_tensors(model, files, config, with_preview=with_preview)
    block = fp8.block_size(config.extra)
    expert_offset = plan.experts.start if plan.moe == "experts" else 0
    read = 0
    with torch.no_grad():
        for item in walk:
            target = item.target
            piece = piece_for(target.param, target, config, plan)
            if piece.skip:
                continue
            if piece.zero:
                walk.params[target.param].zero_()
                continue
            tensor = read_piece(item.handle, item.name, piece)
            read += tensor.numel()
            if tensor.dtype in fp8.FP8_DTYPES:  # block-scaled FP8: dequantize the slice
                tensor = read_fp8_piece(item.handle, item.file, item.name, piece, tensor, walk.found, block)
            copy_into(walk.params, target, tensor, expert_offset=expert_offset)
    return read
