"""Weight-only int8 / int4 quantization of a loaded model (``CLOVERQ_WEIGHT_DTYPE``).

What is quantized, the int4 groups and the bytes are ``quant_rules``' (shared with the planner).
``quantize_model`` replaces each quantized ``nn.Linear`` by an ``Int8Linear`` / ``Int4Linear`` and
each stacked expert parameter (``w_gate_up`` ``[E, H, 2I]``, ``w_down`` ``[E, I, H]``) by a
``QuantizedExperts`` module, which ``moe._grouped_matmul`` hands the routed rows to. Everything
else keeps the model's dtype, and so do activations, except that the fused kernels below take
bfloat16 inputs: a float32 model's rows are rounded to bfloat16 going into one and its output is
cast back.

**Kernels: torch's own, chosen by measurement.** torchao 0.18.0 (the newest; it installs and
imports with torch 2.13.0+cpu, in 7 s, warning about its CUDA-only extensions) was tried first on
this repository's CPU (AVX2, no AVX-512/AMX; 1 thread, ``[2048 x 2048]``): its
``Int8WeightOnlyConfig`` ran 1.0-3.0x *slower* than the float32 ``nn.Linear`` at 1-32 rows (2316 vs
772 us at 1 row: it dequantizes per call), and ``Int4WeightOnlyConfig`` has no CPU path (``plain``
needs the ``mslk`` package, ``plain_int32`` "does not support device 'cpu'", ``tile_packed_to_4d``
needs CUDA). So torchao is not a dependency. torch's CPU kernels (gpt-fast's) measured, best of 5 in
process CPU time, 48 distinct matrices cycled so that weights come from DRAM as in a forward
(microseconds per matmul, float32 MKL as the baseline)::

    [512 -> 1024]            rows:     1     4     8    12    16    24    32   128
    float32 matmul                   209   399   402   515   554   650   714  1881
    _weight_int8pack_mm (bf16 in)     91   144   247   361   460   688   843  3482
    int8 -> float32, then matmul     135     -   304     -   916   490   576  1799
    [512 -> 448] fp32 / int8pack / dequantize at 8 rows: 199 / 119 / 143; at 16: 241 / 213 / 184

The fused int8 kernel wins while a matmul has few rows (a denoising pass of a few sequences; an
expert's share of the routed rows) and loses to dequantize-then-MKL beyond ~12-16 rows, hence
``FUSED_INT8_MAX_ROWS``. It is fast only with bfloat16 inputs (float32 inputs: 8-15x slower than
the float32 matmul; float16: 10x), and it crashes the process for ``K`` not a multiple of 8, so it
is used for ``K % 32 == 0`` only. Its scales are bfloat16, so the codes are rounded against the
rounded scale (the kernel and the dequantized weights agree exactly). ``_weight_int4pack_mm_for_cpu``
(bfloat16 inputs, ``N % 16 == 0``) runs at about float32 speed at 1-8 rows with an eighth of the
bytes and ~2x slower at 128 rows, and its packed layout cannot be dequantized by anything else:
int4 on CPU buys memory, not speed. On CUDA the same ops (``_weight_int8pack_mm``,
``_weight_int4pack_mm`` after ``_convert_weight_to_int4pack``) are used when a probe on the device
says they run and agree with the dequantized reference; that path has not been measured (no GPU
here): ``python -m bench.gpu --weight-dtype int8`` measures it where one is lent. Every path has a
torch fallback that dequantizes then multiplies (also taken when a probe fails).

**Experts.** A batched dispatch (dequantize the experts that received rows, then one
``F.grouped_mm``) measured 1.4-1.9x *slower* than float32's grouped kernel on this CPU at 32-512
routed rows (32 experts of ``[512 -> 448]``: writing the dequantized copy costs more than reading
float32 once). A loop over the experts that received rows, each through the fused kernel (one host
sync for the bounds, as ``moe._looped_matmul``; rows, codes and scales split into per-expert views
in one op each) measured 2.2x faster than float32 at 32 rows (1.43 vs 3.16 ms per layer) and equal
at 512 (the dequantize path takes over as an expert's share passes ``FUSED_INT8_MAX_ROWS``). So CPU
loops (``EXPERT_DISPATCH``); other devices use the batched dequantize + ``moe._grouped_matmul`` (no
per-expert launches; unmeasured).

**Whole passes** (``python -m bench.quant --threads 1 --clock cpu``: one denoising pass, a block of
8 per row after 512 committed positions, small demos, float32 elsewhere): int8 1.49x float32 at
batch 1 on Clover (38.0 vs 56.7 ms) and 1.52x on SDAR (39.3 vs 59.5 ms), 1.07x / 0.89x at batch 16
(128 rows per matmul: the dequantize path, about float32's speed); int4 1.52x / 1.66x at batch 1,
0.92x / 0.80x at batch 16; Clover's weights 380 MiB -> 98 MiB (int8) / 58 MiB (int4). bfloat16
runs 0.11-0.45x float32 on this CPU (no native bfloat16 matmul).

Quantization runs where the weights are (``loader.load_model`` loads a checkpoint onto the host, quantizes
there, then moves the int8/int4 model to the device: the full-precision copy never has to fit on
the device). int4 codes are held in a portable nibble layout until ``prepare`` packs them for the
device's kernel; do not move a prepared model across device types.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.model import moe
from worker.model.quant_rules import (
    QUANTIZED_EXPERTS,
    QUANTIZED_LINEARS,
    QuantMode,
    int4_group,
    parse_mode,
)

log = logging.getLogger(__name__)

# rows of one matmul up to which the fused int8 kernel is used; above, dequantize then matmul
FUSED_INT8_MAX_ROWS = 12
# how the stacked experts are dispatched, by device type (others: "batched")
EXPERT_DISPATCH: dict[str, str] = {"cpu": "looped"}
KERNEL_DTYPE = torch.bfloat16  # what the fused kernels take and return

# (device type, index, kind) -> whether the fused kernel runs and agrees with the reference there
_KERNEL_WORKS: dict[tuple[str, int | None, str], bool] = {}
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default  # resolved once: per-call overload lookup costs


# --- quantizing and dequantizing tensors ---------------------------------------------------------
def quantize_int8(w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[..., N, K]`` -> int8 codes ``[..., N, K]`` and bfloat16 scales ``[..., N]`` (symmetric,
    one scale per output row: ``w ~ q * scale``). The codes are rounded against the bfloat16 scale
    itself, so the kernels (which take bfloat16 scales) and the dequantized weights agree exactly.

    ``amax`` ``[..., N]``: the rows' max magnitude when ``w`` holds only some of each row's inputs
    (a row-parallel shard: the whole row's, so that every shard shares the row's scale)."""
    if amax is None:
        amax = row_amax(w)
    amax = amax.to(w.device, torch.float32)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(torch.bfloat16)
    q = (w.float() / scale.float()[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


def row_amax(w: torch.Tensor) -> torch.Tensor:
    """Max magnitude of each row of ``w`` ``[..., N, K]`` -> ``[..., N]`` (the int8 scale's input)."""
    lo, hi = torch.aminmax(w, dim=-1)
    return torch.maximum(-lo, hi)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None]


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[..., N, K]`` -> uint8 codes 0..15 ``[..., N, K]`` and bfloat16 (scale, zero)
    ``[..., K/g, N, 2]`` with ``w ~ (q - 8) * scale + zero`` per group of ``group`` inputs (the
    tinygemm form)."""
    *lead, n, k = w.shape
    wg = w.reshape(*lead, n, k // group, group).to(torch.float32, copy=True)  # worked on in place below
    lo, hi = torch.aminmax(wg, dim=-1)  # [..., N, G]
    scale = ((hi - lo).clamp(min=1e-8) / 15.0).to(torch.bfloat16)
    zero = (lo + 8.0 * scale.float()).to(torch.bfloat16)
    low = zero.float() - 8.0 * scale.float()  # the value code 0 stands for, with the rounded params
    q = wg.sub_(low[..., None]).div_(scale.float()[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    scales_zeros = torch.stack((scale, zero), dim=-1).transpose(-3, -2).contiguous()  # [..., G, N, 2]
    return q.reshape(*lead, n, k), scales_zeros


def dequantize_int4(codes: torch.Tensor, scales_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 codes ``[N, K]`` and ``[K/g, N, 2]`` -> float32 ``[N, K]``."""
    n, k = codes.shape
    scale = scales_zeros[..., 0].float().T[..., None]  # [N, G, 1]
    zero = scales_zeros[..., 1].float().T[..., None]
    return ((codes.reshape(n, k // group, group).float() - 8.0) * scale + zero).reshape(n, k)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., K]`` (0..15) -> ``[..., K/2]``: even inputs in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


# --- the fused kernels, probed once per device ----------------------------------------------------
def _cuda_inner_k_tiles(k: int) -> int | None:
    return next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)


def _pack_int4(codes: torch.Tensor, layout: str) -> torch.Tensor:
    """uint8 codes ``[N, K]`` on their device -> the weight tensor ``layout``'s kernel takes."""
    if layout == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    if layout == "cuda":
        tiles = _cuda_inner_k_tiles(codes.shape[1])
        assert tiles is not None
        packed = (codes[:, 0::2] << 4) | codes[:, 1::2]  # tinygemm's uint8 order: even input high
        return torch.ops.aten._convert_weight_to_int4pack(packed.contiguous(), tiles)
    return pack_nibbles(codes)


def _int4_kernel(x: torch.Tensor, weight: torch.Tensor, group: int, sz: torch.Tensor, layout: str) -> Any:
    if layout == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, group, sz)
    return torch.ops.aten._weight_int4pack_mm(x, weight, group, sz)


def _probe(device: torch.device, kind: str) -> bool:
    """Whether ``kind``'s fused kernel runs on ``device`` and matches the dequantized reference."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(32, 128, generator=gen)
    x = torch.randn(3, 128, generator=gen).to(KERNEL_DTYPE)
    try:
        if kind == "int8":
            q, scale = quantize_int8(w)
            ref = x.float() @ dequantize_int8(q, scale).T
            got = _INT8_MM(x.to(device), q.to(device), scale.to(device)).float().cpu()
        else:
            layout = "cpu" if device.type == "cpu" else "cuda"
            codes, sz = quantize_int4(w, 32)
            ref = x.float() @ dequantize_int4(codes, sz, 32).T
            weight = _pack_int4(codes.to(device), layout)
            got = _int4_kernel(x.to(device), weight, 32, sz.to(device), layout).float().cpu()
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return bool(torch.allclose(got, ref, atol=0.05, rtol=0.02))


def kernel_works(device: torch.device, kind: str) -> bool:
    if device.type not in ("cpu", "cuda"):
        return False
    key = (device.type, device.index, kind)
    if key not in _KERNEL_WORKS:
        _KERNEL_WORKS[key] = _probe(device, kind)
        log.debug("fused %s kernel on %s: %s", kind, device, _KERNEL_WORKS[key])
    return _KERNEL_WORKS[key]


def _fused_int8(x: torch.Tensor, k: int) -> bool:
    """Whether ``x``'s rows go through the fused int8 kernel (few rows, a safe width, a working kernel)."""
    return x.shape[0] <= FUSED_INT8_MAX_ROWS and k % 32 == 0 and kernel_works(x.device, "int8")


def int8_matmul(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    x_kernel: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` ``[M, K]`` times the int8 matrix ``q`` ``[N, K]`` (rows scaled by the bfloat16 ``scale``) ->
    ``[M, N]`` in ``x``'s dtype, written into ``out`` when given; ``x_kernel``: ``x`` already in
    ``KERNEL_DTYPE``."""
    if _fused_int8(x, q.shape[1]):
        xk = (x_kernel if x_kernel is not None else x.to(KERNEL_DTYPE)).contiguous()
        result = _INT8_MM(xk, q, scale)  # [M, N] bf16
    else:  # the fallback (and the many-rows path): dequantize, then matmul
        result = torch.mm(x, q.to(x.dtype).T).mul_(scale.to(x.dtype))
    if out is not None:
        return out.copy_(result)
    return result.to(x.dtype)


def int4_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group: int,
    layout: str,
    *,
    x_kernel: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` ``[M, K]`` times an int4 matrix held in ``layout`` -> ``[M, N]`` in ``x``'s dtype."""
    if layout == "plain":  # the fallback: dequantize, then matmul
        w = dequantize_int4(unpack_nibbles(weight), scales_zeros, group)
        return x @ w.to(x.dtype).T
    if weight.device.type != layout:
        raise RuntimeError(f"int4 weights packed for {layout} are on {weight.device}: quantize on the host "
                           "and call prepare() after moving the model")
    xk = (x_kernel if x_kernel is not None else x.to(KERNEL_DTYPE)).contiguous()
    return _int4_kernel(xk, weight, group, scales_zeros, layout).to(x.dtype)


def _int4_layout(device: torch.device, n: int, k: int) -> str:
    if device.type == "cpu" and n % 16 == 0 and kernel_works(device, "int4"):
        return "cpu"
    if device.type == "cuda" and n % 8 == 0 and _cuda_inner_k_tiles(k) and kernel_works(device, "int4"):
        return "cuda"
    return "plain"


# --- modules --------------------------------------------------------------------------------------
class Int8Linear(nn.Module):
    """``nn.Linear`` with an int8 weight ``[N, K]`` and a bfloat16 scale per output row."""

    qweight: torch.Tensor  # buffers
    scale: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, amax: torch.Tensor | None = None) -> Int8Linear:
        q, scale = quantize_int8(linear.weight.detach(), amax)
        return cls(q, scale, linear.bias)

    def dequantized(self) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_matmul(x.reshape(-1, self.in_features), self.qweight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


class Int4Linear(nn.Module):
    """``nn.Linear`` with a group-wise int4 weight (``quantize_int4``), packed for ``layout``'s kernel."""

    qweight: torch.Tensor  # buffers
    scales_zeros: torch.Tensor

    def __init__(
        self, codes: torch.Tensor, scales_zeros: torch.Tensor, group: int, bias: nn.Parameter | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group = group
        self.layout = "plain"
        self.register_buffer("qweight", pack_nibbles(codes))
        self.register_buffer("scales_zeros", scales_zeros)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int) -> Int4Linear:
        codes, sz = quantize_int4(linear.weight.detach(), group)
        return cls(codes, sz, group, linear.bias)

    def prepare(self) -> None:
        """Pack the codes for the kernel of the device they are on (once, after the last move)."""
        if self.layout != "plain":
            return
        layout = _int4_layout(self.qweight.device, self.out_features, self.in_features)
        if layout != "plain":
            self.qweight = _pack_int4(unpack_nibbles(self.qweight), layout)
            self.layout = layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = int4_matmul(x2, self.qweight, self.scales_zeros, self.group, self.layout)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 group "
                f"{self.group} ({self.layout})")


class QuantizedExperts(nn.Module):
    """A stacked expert matrix ``[E, K in, N out]`` held as ``E`` quantized ``[N, K]`` matrices.

    ``moe._grouped_matmul`` calls ``grouped_matmul`` with the copies sorted by expert; ``shape``
    is the stack's, as the parameter it replaces.
    """

    qweight: torch.Tensor  # buffers
    scales: torch.Tensor

    def __init__(self, stack: torch.Tensor, mode: QuantMode, amax: torch.Tensor | None = None) -> None:
        """``amax`` ``[E, N]``: as ``quantize_int8``'s (int8 only; a row-parallel shard's whole rows)."""
        super().__init__()
        self.num_experts, self.in_features, self.out_features = stack.shape
        group = int4_group(self.in_features, mode.group_size) if mode.kind == "int4" else None
        self.kind = "int4" if group else "int8"
        self.group = group or 0
        self.layout = "plain"
        self.dispatch = "looped"
        e, k, n = stack.shape
        codes = stack.new_empty((e, n, k // 2 if group else k), dtype=torch.uint8 if group else torch.int8)
        scales = stack.new_empty((e, k // group, n, 2) if group else (e, n), dtype=torch.bfloat16)
        chunk = max(1, (1 << 24) // (n * k))  # experts per step: float32 temporaries of ~64 MiB
        for lo in range(0, e, chunk):
            w = stack[lo : lo + chunk].transpose(1, 2)  # [c, N, K]
            q, s = quantize_int4(w, group) if group else quantize_int8(
                w, None if amax is None else amax[lo : lo + chunk])
            codes[lo : lo + chunk] = pack_nibbles(q) if group else q
            scales[lo : lo + chunk] = s
        self.register_buffer("qweight", codes)  # [E, N, K] int8 or [E, N, K/2] uint8 nibbles
        self.register_buffer("scales", scales)  # [E, N] or [E, K/g, N, 2] bf16

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.num_experts, self.in_features, self.out_features))

    def prepare(self) -> None:
        """Choose the dispatch for the device and pack int4 codes for its kernel (looped only)."""
        device = self.qweight.device
        self.dispatch = EXPERT_DISPATCH.get(device.type, "batched")
        if self.kind == "int4" and self.layout == "plain" and self.dispatch == "looped":
            layout = _int4_layout(device, self.out_features, self.in_features)
            if layout != "plain":
                self.qweight = torch.stack([_pack_int4(unpack_nibbles(q), layout) for q in self.qweight])
                self.layout = layout

    def dequantized(self, experts: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[U, N, K]`` of ``experts`` (all when ``None``); plain layout only."""
        q = self.qweight if experts is None else self.qweight.index_select(0, experts)
        s = self.scales if experts is None else self.scales.index_select(0, experts)
        if self.kind == "int8":
            return dequantize_int8(q, s)
        pairs = zip(q, s, strict=True)
        return torch.stack([dequantize_int4(unpack_nibbles(a), b, self.group) for a, b in pairs])

    def grouped_matmul(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Rows ``offsets[e-1]:offsets[e]`` of ``x`` ``[R, K]`` times expert ``e`` -> ``[R, N]``."""
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        if self.dispatch == "looped":  # one host sync for the bounds, then the experts with rows
            out = x.new_empty(x.shape[0], self.out_features)
            counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
            xk = x.to(KERNEL_DTYPE)  # cast once for every expert's fused kernel
            # every expert's rows, codes and scales as views made in one op each (no per-expert slicing)
            views = (x.split(counts), xk.split(counts), out.split(counts), self.qweight.unbind(0),
                     self.scales.unbind(0), counts)  # fmt: skip
            for xe, xke, oute, q, s, n in zip(*views, strict=True):
                if not n:
                    continue
                if self.kind == "int8":
                    int8_matmul(xe, q, s, out=oute, x_kernel=xke)
                else:
                    oute.copy_(int4_matmul(xe, q, s, self.group, self.layout, x_kernel=xke))
            return out
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        used = torch.nonzero(counts).squeeze(1)  # experts that received rows (one host sync)
        w = self.dequantized(used).to(x.dtype).transpose(1, 2)  # [U, K, N]
        return moe._grouped_matmul(x, w, offsets.index_select(0, used).to(torch.int32))

    def extra_repr(self) -> str:
        kind = "int8 per channel" if self.kind == "int8" else f"int4 group {self.group} ({self.layout})"
        return f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, {kind}"


QUANTIZED_MODULES = (Int8Linear, Int4Linear, QuantizedExperts)


def quantized_linear(
    linear: nn.Linear, mode: QuantMode, amax: torch.Tensor | None = None
) -> Int8Linear | Int4Linear:
    """``amax``: as ``quantize_int8``'s, used where the matrix is held in int8."""
    group = int4_group(linear.in_features, mode.group_size) if mode.kind == "int4" else None
    return Int4Linear.from_linear(linear, group) if group else Int8Linear.from_linear(linear, amax)


# --- the model --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantReport:
    mode: QuantMode
    linears: int  # nn.Linear modules replaced
    expert_stacks: int  # stacked expert tensors replaced
    bytes_before: int
    bytes_after: int

    def __str__(self) -> str:
        return (f"weights {self.mode}: {self.linears} projections and {self.expert_stacks} expert stacks "
                f"quantized, {self.bytes_before / 2**20:.1f} MiB -> {self.bytes_after / 2**20:.1f} MiB")


def model_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model`` (a tied tensor once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in itertools.chain(model.parameters(), model.buffers()):
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    mode: QuantMode | str,
    *,
    device: torch.device | str | None = None,
    row_amax: dict[str, torch.Tensor] | None = None,
) -> QuantReport:
    """Quantize ``model`` in place where its weights are, move it to ``device`` (if given) and pack
    the int4 codes for that device's kernels.

    ``row_amax``: qualified name of a matrix (``layers.0.attn.o_proj``, ``layers.1.mlp.w_down``) ->
    the max magnitude of each of its output rows over the *whole* row, for a tensor-parallel shard
    that holds only some of each row's inputs (``parallel/quant.py``); used where it is held in int8."""
    amaxes = row_amax or {}
    parsed = parse_mode(mode)
    if parsed is None:
        raise ValueError(f"no quantization mode in {mode!r}")
    before = model_bytes(model)
    linears = stacks = 0
    for prefix, module in list(model.named_modules()):
        if isinstance(module, QUANTIZED_MODULES):
            continue
        at = f"{prefix}." if prefix else ""
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and name in QUANTIZED_LINEARS:
                setattr(module, name, quantized_linear(child, parsed, amaxes.get(at + name)))
                linears += 1
        for name in QUANTIZED_EXPERTS:
            param = module._parameters.get(name)
            if param is not None and param.ndim == 3:
                del module._parameters[name]
                setattr(module, name, QuantizedExperts(param.detach(), parsed, amaxes.get(at + name)))
                stacks += 1
    if device is not None:
        model.to(device)
    prepare(model)
    report = QuantReport(parsed, linears, stacks, before, model_bytes(model))
    log.info("%s", report)
    return report


def prepare(model: nn.Module) -> None:
    """Pack int4 codes and choose expert dispatch for the device the model is on now."""
    for m in model.modules():
        if isinstance(m, (Int4Linear, QuantizedExperts)):
            m.prepare()
