"""``python -m bench.gpu_profile``: where one forward's time goes, on a GPU, for Clover and SDAR shapes.

The first GPU run of ``bench.gpu`` and ``bench.gpu_clover`` (H200, torch 2.11) found every
denoising pass taking 110-150 ms at batch 1 with the forward ~98% of it, about 1-6% of the memory
bandwidth: host-bound. This script times one forward of ``tokens`` rows (one block of a batch,
full attention inside the block, no cache: the shape of a denoising pass) with CUDA events, with
the routed experts through ``F.grouped_mm`` (when it probes fine) and through the per-expert loop,
and prints the profiler's top operators by device time and by host time, so the next change is
chosen by measurement. ``--tiny`` checks the script on a CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu import build_random_model, sdar_30b_a3b_config
from bench.gpu import parse_args as gpu_args
from bench.gpu_clover import build_random_clover, clover_config
from worker.model import moe
from worker.model.family import DiffusionModel


def _forward(model: DiffusionModel, tokens: int, device: torch.device) -> None:
    ids = torch.randint(0, model.config.vocab_size - 1, (1, tokens), device=device)  # [1, T]
    positions = torch.arange(tokens, device=device)[None]  # [1, T]
    model(ids, positions, torch.zeros_like(positions))  # one block: bidirectional, like a pass


def timed_ms(model: DiffusionModel, tokens: int, device: torch.device, repeats: int) -> float:
    """Median wall time of one forward over ``tokens`` rows, after two warm-ups."""
    times = []
    for i in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        _forward(model, tokens, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append((time.perf_counter() - began) * 1e3)
    return sorted(times)[len(times) // 2]


def profile_table(model: DiffusionModel, tokens: int, device: torch.device, rows: int) -> str:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _forward(model, tokens, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    by_device = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    return (
        f"-- by {'device' if device.type == 'cuda' else 'host'} time\n"
        + events.table(sort_by=by_device, row_limit=rows, max_name_column_width=60)
        + "\n-- by host time (self)\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)
    )


def measure(name: str, model: DiffusionModel, args: argparse.Namespace, device: torch.device) -> None:
    print(f"\n=== {name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")
    with torch.inference_mode():
        _forward(model, 8, device)  # the grouped_mm probe runs here
        grouped = dict(moe._GROUPED_MM_WORKS)
        print(f"grouped_mm probe: {grouped}")
        for tokens in args.tokens:
            row = [f"{tokens:>5} rows:"]
            for use_grouped in (True, False):
                for key in list(moe._GROUPED_MM_WORKS):
                    moe._GROUPED_MM_WORKS[key] = use_grouped and grouped[key]
                label = "grouped_mm" if use_grouped and any(grouped.values()) else "expert loop"
                row.append(f"{label} {timed_ms(model, tokens, device, args.repeats):8.1f} ms")
                if not any(grouped.values()):
                    break
            print("   ".join(row), flush=True)
        moe._GROUPED_MM_WORKS.update(grouped)
        for tokens in args.profile_tokens:
            print(f"\nprofile of one {tokens}-row forward (grouped_mm as probed)")
            print(profile_table(model, tokens, device, args.rows), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--models", default="clover,sdar")
    parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[32, 256, 2048])
    parser.add_argument("--profile-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=18)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}   "
          f"torch {torch.__version__}   dtype {args.dtype}")
    for name in args.models.split(","):
        if name == "clover":
            model = build_random_clover(clover_config(args.tiny), device=device, dtype=dtype)
        else:
            reduced = ["--layers", "2", "--experts", "8", "--top-k", "2", "--hidden", "128",
                       "--moe-intermediate", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
                       "--vocab", "1024"]  # fmt: skip
            config = sdar_30b_a3b_config(gpu_args(reduced if args.tiny else []))
            model = build_random_model(config, device=device, dtype=dtype)
        measure(name, model, args, device)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
