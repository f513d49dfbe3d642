"""What weight quantization stores, in plain Python (no torch): shared by ``quantize`` and ``planner``.

One place decides which matrices are quantized, with which int4 group, and how many bytes each
takes, so the planner's prediction and the worker's model are built from the same rules:

- ``int8``: per-output-channel symmetric int8, one bfloat16 scale per output row (the kernels take
  bfloat16 scales; the codes are rounded against the rounded scale): ``N*K + 2*N`` bytes for an
  ``[N out, K in]`` matrix.
- ``int4``: group-wise asymmetric int4 along the input dim (the tinygemm form gpt-fast and torch's
  ``_weight_int4pack_mm*`` kernels use: ``w = (q - 8) * scale + zero``), two nibbles per byte and a
  bfloat16 (scale, zero) pair per group: ``N*K/2 + 4*N*K/g`` bytes. The group is the one asked for
  (32, 64 or 128) or, where ``K`` is not a multiple of it, the largest of those that divides ``K``;
  a matrix no group divides is held in int8 instead.

Quantized: the stacked routed experts (``w_gate_up``, ``w_down``) and the projection matrices
(``nn.Linear`` named in ``QUANTIZED_LINEARS``: attention q/k/v/o, GDN ``in_proj_qkv`` /
``in_proj_z`` / ``out_proj``, dense and shared-expert MLPs). High precision (the model's dtype):
embeddings, the LM head, norms, the router (``mlp.router``) and ``shared_expert_gate``, the GDN
gates (``in_proj_a``, ``in_proj_b``, ``A_log``, ``dt_bias``), conv taps, the block-diffusion
preview tensors and biases.
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT_DTYPES: tuple[str, ...] = ("int8", "int4")
INT4_GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
DEFAULT_INT4_GROUP = 64
# attribute names of the nn.Linear modules that are quantized (every other Linear stays as it is)
QUANTIZED_LINEARS: frozenset[str] = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "in_proj_qkv",
        "in_proj_z",
        "out_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
)
# stacked expert parameters ([E, K in, N out]) that are quantized
QUANTIZED_EXPERTS: frozenset[str] = frozenset({"w_gate_up", "w_down"})


@dataclass(frozen=True)
class QuantMode:
    """``kind`` int8 or int4; ``group_size`` (int4 only) the requested group along the input dim."""

    kind: str
    group_size: int = DEFAULT_INT4_GROUP

    def __post_init__(self) -> None:
        if self.kind not in WEIGHT_DTYPES:
            raise ValueError(f"weight dtype {self.kind!r} is not one of {list(WEIGHT_DTYPES)}")
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size {self.group_size} is not one of {list(INT4_GROUP_SIZES)}")

    def __str__(self) -> str:
        return self.kind if self.kind == "int8" else f"int4 (group {self.group_size})"


def parse_mode(weight_dtype: str | QuantMode | None, group_size: int | None = None) -> QuantMode | None:
    """``None``/``""`` (no quantization), ``int8``, ``int4`` or ``int4-g32``/``int4-g64``/``int4-g128``."""
    if weight_dtype is None or isinstance(weight_dtype, QuantMode):
        return weight_dtype
    text = weight_dtype.strip().lower()
    if not text or text in ("none", "auto"):
        return None
    kind, _, group = text.partition("-g")
    size = int(group) if group else (group_size or DEFAULT_INT4_GROUP)
    return QuantMode(kind, size)


def int4_group(k: int, requested: int) -> int | None:
    """The int4 group used for input width ``k``: ``requested`` or the largest smaller one dividing
    ``k``; ``None`` when none does (the matrix is held in int8)."""
    for g in sorted(INT4_GROUP_SIZES, reverse=True):
        if g <= requested and k % g == 0:
            return g
    return None


def matrix_bytes(n: int, k: int, mode: QuantMode) -> int:
    """Bytes of one quantized ``[n out, k in]`` matrix (codes plus scales)."""
    if mode.kind == "int4":
        g = int4_group(k, mode.group_size)
        if g is not None:
            return n * k // 2 + 4 * n * (k // g)
    return n * k + 2 * n
