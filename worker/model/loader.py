"""The worker's model-loading entry point: a checkpoint folder, then its weight format.

``load_model`` is what a one-device worker, ``cloverq generate`` and ``cloverq model plan
--check`` call: ``checkpoint.load_checkpoint``, then ``CLOVERQ_WEIGHT_DTYPE`` (int8/int4 weight-only
quantization, ``quantize.py``) where one is asked for. A tensor-parallel worker loads through
``parallel/launch.py`` ``load_tensor_parallel`` instead, with the same options per rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from worker.model.checkpoint import load_checkpoint
from worker.model.quant_rules import QuantMode, parse_mode
from worker.model.quantize import quantize_model


def load_model(
    path: Path | str,
    *,
    device: torch.device | str = "cpu",
    weight_dtype: QuantMode | str | None = None,
    group_size: int | None = None,
    **load_kwargs: Any,
) -> Any:
    """``checkpoint.load_checkpoint`` (``load_kwargs``: dtype, verify, ...), then, with ``weight_dtype``,
    quantization: the checkpoint is read onto the host, quantized there and moved to ``device``, so
    its full-precision copy never has to fit on the device. Returns the ``LoadedModel``."""
    mode = parse_mode(weight_dtype, group_size)
    if mode is None:
        return load_checkpoint(path, device=device, **load_kwargs)
    loaded = load_checkpoint(path, device="cpu", **load_kwargs)
    quantize_model(loaded.model, mode, device=device)
    return loaded
