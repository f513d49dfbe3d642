"""Back-of-the-envelope capacity plan for serving an MoE model: memory, compute, GPU count.

An MoE model must hold *all* its experts in memory (weights scale with total parameters) while each
token only runs through the routed ones (compute scales with active parameters). The KV cache
scales with attention layers x KV heads x head dim x context x concurrent sequences; a hybrid
model's recurrent (Gated DeltaNet) layers instead hold a fixed state per sequence, whatever its
length (the worker keeps two float32 copies of each: see ``HybridCache``). Plans are sized with a
headroom factor (activations, fragmentation, CUDA context) of 1.3-1.5x.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler.fleet.sequence_memory import SequenceMemory
from worker.model.parallel.plan import make_plan, rank_config
from worker.model.quant_rules import DEFAULT_INT4_GROUP, QuantMode, matrix_bytes

if TYPE_CHECKING:
    from worker.model.config import ModelConfig

BYTES_PER_PARAM: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}
GIB = 1024**3


@dataclass(frozen=True)
class PlanInput:
    total_params: float
    active_params: float
    dtype: str  # weight dtype, a key of BYTES_PER_PARAM
    context: int  # positions per sequence
    batch: int  # concurrent sequences
    layers: int  # layers that keep K/V per position (a hybrid model's attention layers)
    kv_heads: int
    head_dim: int
    attention_heads: int
    state_bytes_per_sequence: float = 0.0  # recurrent-layer state per sequence (hybrid models)
    prefix_cache_bytes: float = 0.0  # the engine's store of shared prompt prefixes (its budget)
    kv_dtype: str = "bf16"
    gpu_memory_gib: float = 80.0
    headroom: float = 1.4
    # exact weight bytes per row dtype when known (``weight_bytes`` of a config: quantized matrices
    # plus what stays high precision); a dtype missing here is total_params x BYTES_PER_PARAM
    weight_bytes: Mapping[str, float] = field(default_factory=dict)

    @property
    def memory(self) -> SequenceMemory:
        """What one sequence holds (``scheduler.fleet.sequence_memory``: the API's submit check
        counts with the same formula)."""
        return SequenceMemory(attention_layers=self.layers, kv_heads=self.kv_heads, head_dim=self.head_dim,
                              kv_element_bytes=BYTES_PER_PARAM[self.kv_dtype],
                              state_bytes=int(self.state_bytes_per_sequence))

    def __post_init__(self) -> None:
        for name in (self.dtype, self.kv_dtype):
            if name not in BYTES_PER_PARAM:
                raise ValueError(f"dtype {name!r} is not one of {sorted(BYTES_PER_PARAM)}")
        if not 1.3 <= self.headroom <= 1.5:
            raise ValueError(f"headroom {self.headroom} is outside 1.3-1.5")


@dataclass(frozen=True)
class PlanRow:
    """Memory and GPU count for one weight precision."""

    weight_dtype: str
    weights_gib: float
    kv_gib: float  # K/V of every position, recurrent state of every sequence, the prefix store
    total_gib: float  # weights + KV
    with_headroom_gib: float
    gpus_80gib: int
    gpus_chosen: int


@dataclass(frozen=True)
class Plan:
    input: PlanInput
    kv_bytes_per_token: float  # all layers, K and V
    flops_per_token: float  # forward: 2 x active params + attention over the full context
    rows: tuple[PlanRow, ...]  # the chosen dtype first, then int8 and int4


def _gpus(gib: float, per_gpu: float) -> int:
    return max(1, math.ceil(gib / per_gpu))


def plan(inp: PlanInput) -> Plan:
    kv_per_token = inp.memory.bytes_per_position()
    # Sequences hold their own copy of a shared prefix (the prefix cache saves prefill compute,
    # not slot memory), so the store's budget comes on top of every slot.
    kv_gib = (inp.memory.sequence_bytes(inp.context) * inp.batch + inp.prefix_cache_bytes) / GIB
    attention_flops = 4 * inp.layers * inp.attention_heads * inp.head_dim * inp.context  # QK^T + AV
    dtypes = [inp.dtype] + [d for d in ("int8", "int4") if d != inp.dtype]
    rows = []
    for dtype in dtypes:
        weights = inp.weight_bytes.get(dtype, inp.total_params * BYTES_PER_PARAM[dtype]) / GIB
        total = weights + kv_gib
        sized = total * inp.headroom
        rows.append(
            PlanRow(
                dtype, weights, kv_gib, total, sized, _gpus(sized, 80.0), _gpus(sized, inp.gpu_memory_gib)
            )
        )
    return Plan(inp, kv_per_token, 2 * inp.active_params + attention_flops, tuple(rows))


TP_DEGREES = (1, 2, 4, 8)


def sequences_at_once(inp: PlanInput, weights_gib: float, tp: int) -> int:
    """How many ``inp.context``-token sequences ``tp`` cards of ``inp.gpu_memory_gib`` hold at once
    next to ``weights_gib`` of weights and the prefix store, within the headroom.

    Weights, the recurrent state and the prefix store shard over the ranks (their total is the
    same); K/V shard by KV head, and a rank holds at least one, so beyond ``kv_heads`` ranks the
    K/V heads are replicated: the group holds ``max(kv_heads, tp)`` heads' worth per position."""
    per_sequence = inp.memory.sequence_bytes(inp.context, tp)
    room = tp * inp.gpu_memory_gib * GIB / inp.headroom - weights_gib * GIB - inp.prefix_cache_bytes
    return max(0, math.floor(room / per_sequence))


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def format_plan(p: Plan) -> str:
    """A plain-text report of ``p`` (what ``cloverq model plan`` prints)."""
    i = p.input
    lines = [
        f"model: {_count(i.total_params)} total, {_count(i.active_params)} active parameters; "
        f"{i.layers} layers, {i.attention_heads} q heads, {i.kv_heads} KV heads x {i.head_dim}",
        f"load: batch {i.batch} x context {i.context} = {i.batch * i.context:,} cached positions "
        f"(KV in {i.kv_dtype}: {p.kv_bytes_per_token / 1024:.1f} KiB per position over {i.layers} "
        f"attention layers)"
        + (
            f"; recurrent state {i.state_bytes_per_sequence / 2**20:.1f} MiB per sequence"
            if i.state_bytes_per_sequence
            else ""
        )
        + (f"; prefix store {i.prefix_cache_bytes / GIB:.2f} GiB" if i.prefix_cache_bytes else ""),
        f"compute: {p.flops_per_token / 1e9:.2f} GFLOP per token "
        f"(2 x active = {2 * i.active_params / 1e9:.2f}, attention at full context = "
        f"{(p.flops_per_token - 2 * i.active_params) / 1e9:.2f})",
        f"headroom: x{i.headroom}",
        "",
        f"{'weights':>8} {'weights GiB':>12} {'KV+state':>10} {'total GiB':>10} {'sized GiB':>10} "
        f"{'GPUs@80GiB':>10} {f'GPUs@{i.gpu_memory_gib:g}GiB':>12}",
    ]
    for r in p.rows:
        lines.append(
            f"{r.weight_dtype:>8} {r.weights_gib:>12.1f} {r.kv_gib:>10.1f} {r.total_gib:>10.1f} "
            f"{r.with_headroom_gib:>10.1f} {r.gpus_80gib:>10d} {r.gpus_chosen:>12d}"
        )
    lines += ["", f"sequences of {i.context:,} tokens at once on {i.gpu_memory_gib:g} GiB cards "
              f"(within the headroom; tensor-parallel degree):",
              f"{'weights':>8} " + " ".join(f"{f'TP {tp}':>7}" for tp in TP_DEGREES)]
    for r in p.rows:
        lines.append(f"{r.weight_dtype:>8} "
                     + " ".join(f"{sequences_at_once(i, r.weights_gib, tp):>7d}" for tp in TP_DEGREES))
    return "\n".join(lines)


# --- weight bytes from a config: what a worker holds after load, quantized or not -------------------
FLOAT_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class WeightBytes:
    """Weights of one model in one precision: the quantized matrices and what stays high precision."""

    weight_dtype: str  # fp32 / bf16 / fp16, or int8 / int4 (then ``high_precision`` is the rest's dtype)
    high_precision: str
    quantized_params: int
    quantized_bytes: int
    high_precision_params: int
    high_precision_bytes: int

    @property
    def total(self) -> int:
        return self.quantized_bytes + self.high_precision_bytes


def quantized_matrices(config: ModelConfig) -> list[tuple[str, int, int, int]]:
    """``(what, count, out, in)`` of every matrix ``CLOVERQ_WEIGHT_DTYPE`` quantizes (``quant_rules``),
    read from the config's shapes: attention q/k/v/o, GDN in_proj_qkv/in_proj_z/out_proj, dense and
    shared-expert MLPs, and the routed experts (``count`` = experts of one layer)."""
    h, d = config.hidden_size, config.head_dim
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    gated = 2 if config.family == "clover" else 1  # Clover's q_proj also emits the output gate
    hv, dv = config.linear_num_value_heads, config.linear_value_head_dim
    out: list[tuple[str, int, int, int]] = []
    for layer in range(config.num_hidden_layers):
        if config.is_linear_layer(layer):
            out += [("in_proj_qkv", 1, config.linear_conv_dim, h), ("in_proj_z", 1, hv * dv, h),
                    ("out_proj", 1, h, hv * dv)]  # fmt: skip
        else:
            out += [("q_proj", 1, gated * heads * d, h), ("k_proj", 1, kv * d, h), ("v_proj", 1, kv * d, h),
                    ("o_proj", 1, h, heads * d)]  # fmt: skip
        if config.is_moe_layer(layer):
            e, i, s = config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size
            out += [("experts.w_gate_up", e, 2 * i, h), ("experts.w_down", e, h, i)]
            if s:
                out += [("shared.gate_up", 2, s, h), ("shared.down", 1, h, s)]
        else:
            i = config.intermediate_size
            out += [("dense.gate_up", 2, i, h), ("dense.down", 1, h, i)]
    return out


def weight_bytes(
    config: ModelConfig,
    weight_dtype: str,
    *,
    high_precision: str = "bf16",
    group_size: int = DEFAULT_INT4_GROUP,
) -> WeightBytes:
    """Bytes of ``config``'s weights in ``weight_dtype``: a float dtype holds everything in it; int8 /
    int4 quantize ``quantized_matrices`` (codes and scales, ``quant_rules.matrix_bytes``) and keep the
    rest (embeddings, LM head, norms, routers, GDN gates, conv, preview tensors, biases) in
    ``high_precision``."""
    total, _ = config.param_counts()
    if weight_dtype in FLOAT_DTYPES:
        per = BYTES_PER_PARAM[weight_dtype]
        return WeightBytes(weight_dtype, weight_dtype, 0, 0, total, int(total * per))
    mode = QuantMode(weight_dtype, group_size)
    params = sum(count * n * k for _, count, n, k in quantized_matrices(config))
    qbytes = sum(count * matrix_bytes(n, k, mode) for _, count, n, k in quantized_matrices(config))
    rest = total - params
    return WeightBytes(weight_dtype, high_precision, params, qbytes, rest,
                       int(rest * BYTES_PER_PARAM[high_precision]))  # fmt: skip


def plan_weight_bytes(
    config: ModelConfig, dtype: str, *, group_size: int = DEFAULT_INT4_GROUP
) -> dict[str, float]:
    """``PlanInput.weight_bytes`` for the rows ``plan`` prints (``dtype``, int8, int4); a quantized row
    keeps the rest in ``dtype`` when that is a float dtype, else in bf16."""
    hp = dtype if dtype in FLOAT_DTYPES else "bf16"
    return {
        d: float(weight_bytes(config, d, high_precision=hp, group_size=group_size).total)
        for d in dict.fromkeys((dtype, "int8", "int4"))
    }


def rank_weight_bytes(
    config: ModelConfig,
    weight_dtype: str,
    *,
    world: int,
    rank: int = 0,
    high_precision: str = "bf16",
    group_size: int = DEFAULT_INT4_GROUP,
) -> WeightBytes:
    """``weight_bytes`` of rank ``rank`` of a ``world``-way tensor-parallel worker (experts split by
    columns, the default): its shard's matrices (``parallel.plan.rank_config``'s shapes) quantized as
    each rank does (int4 groups of the shard's own input widths, int8 where none divides them), the
    replicated rest (embedding, norms, routers) whole, the LM head on rank 0 only. Rank 0 holds the
    most."""
    shard = weight_bytes(rank_config(config, make_plan(config, rank, world)), weight_dtype,
                         high_precision=high_precision, group_size=group_size)  # fmt: skip
    if rank == 0 or config.tie_word_embeddings:
        return shard
    head = config.vocab_size * config.hidden_size  # only rank 0 samples
    return dataclasses.replace(shard, high_precision_params=shard.high_precision_params - head,
                               high_precision_bytes=shard.high_precision_bytes
                               - int(head * BYTES_PER_PARAM[shard.high_precision]))  # fmt: skip


def plan_rank_weight_bytes(
    config: ModelConfig, dtype: str, *, world: int, group_size: int = DEFAULT_INT4_GROUP
) -> dict[str, list[int]]:
    """Per-rank weight bytes of a ``world``-way tensor-parallel worker for the rows ``plan`` prints
    (``dtype``, int8, int4), ranks 0..world-1 in order; the high-precision rest as in
    ``plan_weight_bytes``. Raises ``parallel.plan.ShardError`` when the shapes do not split ``world``
    ways. ``cloverq model plan --tensor-parallel`` prints it: one GPU must hold rank 0's share."""
    hp = dtype if dtype in FLOAT_DTYPES else "bf16"
    return {
        d: [rank_weight_bytes(config, d, world=world, rank=r, high_precision=hp, group_size=group_size).total
            for r in range(world)]
        for d in dict.fromkeys((dtype, "int8", "int4"))
    }  # fmt: skip


def format_rank_weight_bytes(world: int, rows: Mapping[str, list[int]]) -> str:
    """The ``--tensor-parallel`` block of ``cloverq model plan``: one line per weight dtype."""
    lines = [f"tensor parallel {world} (experts split by columns): weight bytes per rank"]
    for dtype, per_rank in rows.items():
        ranks = "  ".join(f"rank {r} {b:,} B ({b / GIB:.3f} GiB)" for r, b in enumerate(per_rank))
        lines.append(f"    {dtype:<5} {ranks}")
    return "\n".join(lines)
