"""The messages rank 0 sends down each rank's pipe, as bytes: pickled, tensors as numpy arrays.

A message is a tuple (``("forward", cache_id, inputs)``, ``("free", cache_id, slot)``, ...; the
operations are ``rank_server._serve``'s). Tensors travel on the host and are put on the rank's
device when decoded; bfloat16 and float16 tensors (which numpy cannot hold) travel as tensors.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class _Array:
    """A tensor on the wire: its numpy array (pickles without torch's storage machinery)."""

    array: np.ndarray


def _encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        cpu = value.detach().cpu()
        return cpu if cpu.dtype in (torch.bfloat16, torch.float16) else _Array(cpu.numpy())
    if isinstance(value, tuple):
        return tuple(_encode(v) for v in value)
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(value: Any, device: torch.device) -> Any:
    if isinstance(value, _Array):
        return torch.from_numpy(value.array).to(device)
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_decode(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _decode(v, device) for k, v in value.items()}
    return value


def pack(message: tuple[Any, ...]) -> bytes:
    """``message`` as the bytes one ``send_bytes`` carries."""
    return pickle.dumps(_encode(message), protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes, device: torch.device) -> Any:
    """The message in ``data``, its tensors on ``device``."""
    return _decode(pickle.loads(data), device)
