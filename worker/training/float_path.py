"""The float code path a training run computes on, pinned so its bytes do not depend on the CPU.

One torch thread and deterministic algorithms make a run repeat bit for bit on one machine, but
not across machines: ATen dispatches its vectorised kernels (reductions, softmax, elementwise
ops) by the widest instruction set the CPU has (AVX512 on one machine, AVX2 on another), and MKL
picks its GEMM kernels by CPU model. Either changes the order of float32 sums, and thousands of
optimizer steps carry a last-bit difference into other weights: the same ``train-demo`` command
gave other bytes, and decisions several points apart, on two sessions' machines
(docs/demo-training.md, twelfth round). Both libraries read their path from the environment,
once, before their first kernel: ``ATEN_CPU_CAPABILITY`` and ``MKL_CBWR`` (MKL's conditional
numerical reproducibility: a fixed code branch; ``STRICT`` also makes its GEMMs independent of
the thread count). oneDNN (the GDN layer's short convolution) is pinned alike
(``ONEDNN_MAX_CPU_ISA``), though no difference from it was measured. AVX2 is the widest path
nearly every x86-64 server runs. MKL runs its instruction-set branches (AVX2 among them) on Intel
CPUs only: on an AMD EPYC, ``MKL_CBWR=AVX2,STRICT`` read back as ``AUTO,STRICT`` (MKL's own pick
per CPU model) and ``mkl_cbwr_set`` answered "unsupported branch", so there MKL is pinned to
``COMPATIBLE`` (SSE2), the one branch it runs on every x86-64 CPU. An Intel and an AMD machine
therefore compute on two pinned paths (meant to be the same across each vendor's CPU models:
not measured; a container whose cpuinfo hides the vendor gets COMPATIBLE too); the record says
which. Measured on that 2-core EPYC: COMPATIBLE costs about 25% of a training step against
MKL's own pick (and on a later session's 2-core EPYC, with two threads, 100 steps of p1l's
options took 27 and 30 s pinned against 19 and 18 s on ``CPU_MODEL_PATH``). ``CPU_MODEL_PATH``
(``train-demo --cpu-model-float-path``) is the faster pin for that case: ATen on AVX2 as before,
MKL on ``AUTO,STRICT``, its own branch for the CPU model, in strict mode (alignment-independent
results): the same bytes for the same CPU model and thread count (that session: three runs of
100 steps, the same bytes), not promised across CPU models; the record names the model
(``cpu_model``) and a resume point made on another is refused. On a 2-core Intel Xeon @ 2.80 GHz
(AVX512) MKL read ``AUTO,STRICT`` back and ran, but no faster: 100 steps took 34 and 39 s on it,
36 s on the portable pin (``AVX2,STRICT`` there), 35 s native.
Measured on a 2-core AVX512 Intel machine: the portable pin about 11% slower per step than the
native path, and within 30 steps other bytes than it. The same torch build is assumed (the
project pins it). Another session's Intel machine (AVX512 and AMX) gave the same pinned bytes for
a 30- and a 60-step run as two earlier ones, but also the same native bytes: its CPU chose as
they did, so that the pin bridges two Intel CPUs that choose differently is still not shown.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path
from typing import Any

import torch

# MKL's branch by CPU vendor: its instruction-set branches run on Intel CPUs only (module docstring)
_MKL_PIN_INTEL, _MKL_PIN_OTHER = "AVX2,STRICT", "COMPATIBLE,STRICT"
# the CPU-model pin: MKL's own branch for this CPU model, still strict (module docstring)
MKL_CPU_MODEL = "AUTO,STRICT"


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of Linux's cpuinfo (empty where it is not readable)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if not name.strip() and fields:  # the first processor's block is enough
                break
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``; empty where Linux's cpuinfo is
    not readable)."""
    return _cpuinfo().get("vendor_id", "")


def cpu_model() -> str:
    """The CPU model as Linux's cpuinfo names it (vendor, family, model, stepping, name; empty
    where it is not readable): what ``CPU_MODEL_PATH``'s bytes are promised for."""
    fields = _cpuinfo()
    keys = ("vendor_id", "cpu family", "model", "stepping", "model name")
    return " / ".join(fields.get(key, "?") for key in keys) if fields else ""


def pinned_path(vendor: str, *, cpu_model: bool = False) -> dict[str, str]:
    """The variables that pin a CPU of ``vendor`` (what ``pin_float_path`` sets); ``cpu_model``:
    MKL on its own branch for the CPU model instead of the vendor's portable one."""
    mkl = MKL_CPU_MODEL if cpu_model else _MKL_PIN_INTEL if vendor == "GenuineIntel" else _MKL_PIN_OTHER
    return {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": mkl, "ONEDNN_MAX_CPU_ISA": "AVX2"}


def pinned_record(path: dict[str, str]) -> dict[str, str]:
    """What ``float_path()`` reads back in a process pinned by ``path``."""
    return {"aten": path["ATEN_CPU_CAPABILITY"].upper(), "mkl_cbwr": path["MKL_CBWR"]}


# this machine's pin; ``float_path`` reads back what the process computes on
PINNED_PATH: dict[str, str] = pinned_path(cpu_vendor())
PINNED_RECORD: dict[str, str] = pinned_record(PINNED_PATH)
# the CPU-model pin (``pin_float_path(cpu_model=True)``) and what it reads back
CPU_MODEL_PATH: dict[str, str] = pinned_path(cpu_vendor(), cpu_model=True)
CPU_MODEL_RECORD: dict[str, str] = pinned_record(CPU_MODEL_PATH)


def is_pinned(path: dict[str, object]) -> bool:
    """Whether a recorded path (``float_path()``'s entries, among others) is one of the two pins."""
    return any(all(path.get(name) == value for name, value in record.items())
               for record in (PINNED_RECORD, CPU_MODEL_RECORD))  # fmt: skip


def path_record(threads: int) -> dict[str, object]:
    """What a training run records as the path it computed on: ATen's kernels and MKL's branch,
    the thread count (the threads split each reduction), and on ``CPU_MODEL_PATH`` the CPU model
    (MKL's own branch is chosen by it): a resume point on any other is refused."""
    path: dict[str, object] = {**float_path(), "threads": threads}
    if path["mkl_cbwr"] == MKL_CPU_MODEL:
        path["cpu"] = cpu_model()
    return path


# MKL's branch codes (mkl_cbwr.h): 1 is "off" (MKL's own pick per CPU), STRICT a flag bit
_MKL_BRANCHES = {1: "auto", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2",
                 9: "AVX", 10: "AVX2", 12: "AVX512", 14: "AVX512_E1"}  # fmt: skip
_MKL_STRICT = 0x10000


class FloatPathError(RuntimeError):
    """The path was pinned after torch (ATen or MKL) had already chosen its kernels."""


@functools.cache
def _mkl_cbwr_get() -> Any:
    """MKL's ``mkl_cbwr_get`` inside torch's CPU library, loaded once (None: a build without MKL)."""
    try:
        get = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    return get


def _mkl_branch() -> str:
    """The branch MKL computes on, read back from the MKL inside torch (``unknown``: no MKL)."""
    get = _mkl_cbwr_get()
    if get is None:
        return "unknown"
    code = get(-1)  # MKL_CBWR_ALL: the branch and its flags
    name = _MKL_BRANCHES.get(code & 0xFFFF, hex(code & 0xFFFF))
    return f"{name},STRICT" if code & _MKL_STRICT else name


def float_path() -> dict[str, str]:
    """ATen's kernel set and MKL's branch in this process (read from the libraries, not the
    environment: a variable set after their first kernel changes nothing)."""
    return {"aten": torch.backends.cpu.get_cpu_capability(), "mkl_cbwr": _mkl_branch()}


def has_avx2() -> bool:
    """An x86-64 CPU with AVX2 (Linux: its flags), the only kind the pinned path runs on."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def pin_float_path(*, cpu_model: bool = False) -> dict[str, str]:
    """Pin this process to ``PINNED_PATH`` (this CPU vendor's pin; ``cpu_model``:
    ``CPU_MODEL_PATH``) and return the path in effect; call it before the first tensor operation.

    A CPU without AVX2 cannot run it (ATen would dispatch instructions the CPU lacks), so it keeps
    its own path, which the returned record (and ``training.json``) shows. Pinned too late (ATen
    or MKL already chose), the variables are put back and the pin is refused: the run would
    otherwise compute on the machine's path under a record that says otherwise.
    """
    if not has_avx2():
        return float_path()
    target = CPU_MODEL_PATH if cpu_model else PINNED_PATH
    record = pinned_record(target)
    before = {name: os.environ.get(name) for name in target}
    os.environ.update(target)
    path = float_path()
    mkl_pinned = path["mkl_cbwr"] in (record["mkl_cbwr"], "unknown")  # unknown: a build without MKL
    if path["aten"] != record["aten"] or not mkl_pinned:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        preset = " ".join(f"{name}={value}" for name, value in target.items())
        earlier = before["MKL_CBWR"]
        if path["aten"] == record["aten"] and earlier not in (None, target["MKL_CBWR"]):
            raise FloatPathError(f"MKL computes on {path['mkl_cbwr']}: the process started with "
                                 f"MKL_CBWR={earlier}; unset it (the pin sets {target['MKL_CBWR']})")
        if path["aten"] == record["aten"] and path["mkl_cbwr"].endswith(",STRICT"):  # MKL read ours
            raise FloatPathError(f"MKL computes on {path['mkl_cbwr']}, not the pinned "
                                 f"{target['MKL_CBWR']}: it does not run that branch on this CPU "
                                 f"({cpu_vendor() or 'vendor unknown'}); train with "
                                 "--native-float-path")  # fmt: skip
        raise FloatPathError(f"torch chose its CPU kernels before the float path was pinned ({path}); "
                             f"pin it at the start of the process (or start it with {preset})")  # fmt: skip
    return path
