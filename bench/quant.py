"""``python -m bench.quant``: one denoising pass with int8 / int4 weights vs bfloat16 vs float32, on CPU.

The ``small`` demo checkpoint (``--arch clover``, the default: the Qwen3.5-MoE hybrid trunk, 6 Gated
DeltaNet + 2 attention layers, 32 experts top-4 + shared; ``--arch sdar``: SDAR-MoE) is loaded four
ways: float32, bfloat16, and float32 with weight-only int8 (per output channel) or int4 (groups of
``--group-size``) expert and projection matrices (``worker/model/quantize.py``; embeddings, LM head,
norms, routers and GDN gates stay float32). For batch 1 and 16, every row has ``CACHE_LEN``
committed positions (each variant prefills its own cache with the same prompt) and the pass
previews one block of ``block_size`` positions per row, as the engine's denoising passes do
(nothing is committed, so every call sees the same state). The variants are timed alternately
(background load hits all alike); the table prints the best of ``--iters`` per variant in
milliseconds (wall clock, or process CPU time with ``--clock cpu``), the speed-up over float32
measured in this same run, the weight bytes, and the largest logit difference from float32.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.model import _checkpoint
from worker.model.checkpoint import load_checkpoint
from worker.model.quantize import model_bytes, quantize_model

CACHE_LEN = 512


def _best_ms(fns: list[Callable[[], object]], iters: int, clock: Callable[[], float]) -> list[float]:
    """Best milliseconds of each function on ``clock``, timed round-robin after one warm-up call each."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(iters):
        for i, fn in enumerate(fns):
            start = clock()
            fn()
            best[i] = min(best[i], (clock() - start) * 1000)
    return best


def _variants(folder: Any, group_size: int) -> dict[str, torch.nn.Module]:
    fp32 = load_checkpoint(folder, dtype=torch.float32, verify=False).model
    out: dict[str, torch.nn.Module] = {"fp32": fp32}
    out["bf16"] = load_checkpoint(folder, dtype=torch.bfloat16, verify=False).model
    for mode in ("int8", f"int4-g{group_size}"):
        model = copy.deepcopy(fp32)
        quantize_model(model, mode)
        out[mode.split("-")[0]] = model
    return out


def _pass(model: Any, batch: int, block: int, gen: torch.Generator) -> Callable[[], torch.Tensor]:
    """One denoising pass of ``batch`` rows x ``block`` positions after ``CACHE_LEN`` committed ones."""
    config = model.config
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(gen.initial_seed())  # the same prompt and block for every variant
    prefix = torch.randint(0, config.vocab_size, (batch, CACHE_LEN), generator=g)  # [B, 512]
    ids = torch.randint(0, config.vocab_size, (batch, block), generator=g)  # [B, block]
    prefix_pos = torch.arange(CACHE_LEN).expand(batch, -1)
    cache = model.new_cache(max_seqs=batch, max_len=CACHE_LEN + block, device="cpu", dtype=dtype)
    slots = torch.tensor([cache.allocate() for _ in range(batch)])
    prefix_blocks = prefix_pos // block
    commit = torch.full((batch,), CACHE_LEN)
    model(prefix, prefix_pos, prefix_blocks, cache=cache, slots=slots, commit_lens=commit)
    pos = torch.arange(CACHE_LEN, CACHE_LEN + block).expand(batch, -1)  # [B, block]
    blocks = pos // block  # one block of new positions

    def run() -> torch.Tensor:
        return model(ids, pos, blocks, cache=cache, slots=slots)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["clover", "sdar"], default="clover")
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64, help="int4 group")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: elapsed time; cpu: process CPU time (all threads), steadier on a shared machine",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time

    folder = _checkpoint(args.size, args.arch)
    models = _variants(folder, args.group_size)
    config = models["fp32"].config
    block = config.block_size or 4
    total, active = config.param_counts()
    print(
        f"checkpoint {folder.name}: {total / 1e6:.1f} M total / {active / 1e6:.1f} M active parameters, "
        f"{config.num_experts} experts top-{config.num_experts_per_tok}, {torch.get_num_threads()} threads, "
        f"{CACHE_LEN} committed positions + a block of {block} per row, int4 group {args.group_size}, "
        f"best of {args.iters} ({args.clock} clock)"
    )
    print(f"{'batch':>5} {'weights':>8} {'MiB':>8} {'ms':>9} {'vs fp32':>8} {'max |dlogit|':>13}")
    names = list(models)
    for batch in (int(b) for b in args.batches.split(",")):
        gen = torch.Generator().manual_seed(batch)
        runs = [_pass(models[name], batch, block, gen) for name in names]
        ref = runs[0]()
        diffs = [(run() - ref).abs().max().item() for run in runs]
        times = _best_ms(runs, args.iters, clock)
        for name, ms, diff in zip(names, times, diffs, strict=True):
            mib = model_bytes(models[name]) / 2**20
            print(f"{batch:>5} {name:>8} {mib:>8.1f} {ms:>9.2f} {times[0] / ms:>7.2f}x {diff:>13.2e}")


if __name__ == "__main__":
    main()
