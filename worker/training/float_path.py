"""The float code path a training run computes on, pinned so its bytes do not depend on the CPU.

One torch thread and deterministic algorithms make a run repeat bit for bit on one machine, but
not across machines: ATen dispatches its vectorised kernels (reductions, softmax, elementwise
ops) by the widest instruction set the CPU has (AVX512 on one machine, AVX2 on another), and MKL
picks its GEMM kernels by CPU model. Either changes the order of float32 sums, and thousands of
optimizer steps carry a last-bit difference into other weights: the same ``train-demo`` command
gave other bytes, and decisions several points apart, on two sessions' machines
(docs/demo-training.md, twelfth round). Both libraries read their path from the environment,
once, before their first kernel: ``ATEN_CPU_CAPABILITY`` and ``MKL_CBWR`` (MKL's conditional
numerical reproducibility; ``STRICT`` also removes its dependence on memory alignment). AVX2 is
the widest path nearly every x86-64 server runs. Measured on a 2-core AVX512 machine: about 10%
slower per step than the native path, and within 30 steps other bytes than it.
"""

from __future__ import annotations

import os

import torch

# what ``pin_float_path`` sets; ``float_path`` reads back what the process computes on
PINNED_PATH: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"}


class FloatPathError(RuntimeError):
    """The path was pinned after torch had already chosen its kernels."""


def float_path() -> dict[str, str]:
    """ATen's kernel set in this process and the MKL branch it was told (``auto``: MKL's own pick)."""
    return {"aten": torch.backends.cpu.get_cpu_capability(), "mkl_cbwr": os.environ.get("MKL_CBWR", "auto")}


def pin_float_path() -> dict[str, str]:
    """Pin this process to ``PINNED_PATH``; call it before the first tensor operation.

    ATen reads its variable once, when it first dispatches a kernel: if it already chose AVX512,
    pinning now would change nothing and the run would silently compute on the machine's path,
    so that is refused. A CPU without AVX2 (another architecture) keeps its own path, which the
    returned record (and ``training.json``) shows.
    """
    os.environ.update(PINNED_PATH)
    path = float_path()
    if path["aten"] == "AVX512":  # AVX2 is a subset: ATen ignored the variable, it chose earlier
        raise FloatPathError("torch chose its CPU kernels before the float path was pinned; "
                             "pin it at the start of the process (or set ATEN_CPU_CAPABILITY=avx2 "
                             "and MKL_CBWR=AVX2,STRICT in its environment)")  # fmt: skip
    return path
