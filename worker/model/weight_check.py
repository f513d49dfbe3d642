"""``cloverq model plan --check DIR``: the bytes a loaded (and quantized) model measures, next to
the planner's prediction (``planner.weight_bytes``) for the same checkpoint and weight format."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.model.loader import load_model
from worker.model.planner import WeightBytes, weight_bytes
from worker.model.quant_rules import DEFAULT_INT4_GROUP, QuantMode, parse_mode
from worker.model.quantize import model_bytes

_PLANNER_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class WeightCheck:
    folder: Path
    high_precision: str  # the planner's name of the loaded dtype
    mode: QuantMode | None
    predicted: WeightBytes
    measured: int  # parameter + buffer bytes of the loaded (and quantized) model
    seconds: float

    @property
    def error(self) -> float:
        return self.measured / self.predicted.total - 1.0

    def lines(self) -> list[str]:
        mib = 2**20
        what = self.high_precision + (f" + {self.mode}" if self.mode else "")
        p = self.predicted
        return [
            f"check: {self.folder} loaded on CPU in {self.seconds:.1f} s as {what}: measured "
            f"{self.measured / mib:.2f} MiB of parameters and buffers, predicted {p.total / mib:.2f} MiB "
            f"({100 * self.error:+.2f}%)",
            f"       predicted: {p.quantized_params / 1e6:.2f} M quantized parameters in "
            f"{p.quantized_bytes / mib:.2f} MiB, {p.high_precision_params / 1e6:.2f} M kept in "
            f"{p.high_precision} in {p.high_precision_bytes / mib:.2f} MiB",
        ]


def check_checkpoint(
    folder: Path | str,
    *,
    weight_dtype: QuantMode | str | None = None,
    group_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> WeightCheck:
    """Load ``folder`` on the CPU (in ``dtype``, default the checkpoint's), quantize it as the worker
    would, and compare its parameter + buffer bytes with ``planner.weight_bytes``."""
    mode = parse_mode(weight_dtype, group_size)
    began = time.monotonic()
    loaded = load_model(folder, device="cpu", weight_dtype=mode, dtype=dtype, verify=False)
    seconds = time.monotonic() - began
    hp = _PLANNER_DTYPES[next(loaded.model.parameters()).dtype]
    kind = mode.kind if mode else hp
    group = mode.group_size if mode else DEFAULT_INT4_GROUP
    predicted = weight_bytes(loaded.config, kind, high_precision=hp, group_size=group)
    return WeightCheck(Path(folder), hp, mode, predicted, model_bytes(loaded.model), seconds)
