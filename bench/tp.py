"""``python -m bench.tp``: one forward at tensor-parallel degree 2 vs 1, on CPU (gloo).

The ``small`` demo checkpoint of each family (``--arch``), float32. Each row holds ``--cache``
committed positions (prefilled once), then the timed call is a denoising pass: a block of
``--block`` new positions per row against that cache, logits for the block, nothing committed
(so every call sees the same state). Columns, best of ``--iters`` wall-clock milliseconds:

- ``tp1/T``: the plain model with all ``T`` torch threads (what a one-device worker runs);
- ``tp1/1``: the plain model on one thread (the work of one rank before it is split);
- ``tp2 cols``: 2 ranks (this process and one spawned), ``T/2`` threads each, experts split by
  columns (``moe="columns"``, the default);
- ``tp2 ep``: 2 ranks with expert parallelism (each rank holds half the experts whole).

The TP=1 and TP=2 calls alternate, so background load hits both alike. ``ep imb`` is the expert-
parallel load imbalance of that batch: the busiest rank's routed token copies over the mean (the
rank everyone waits for at the all-reduce). ``max |dlogit|`` compares TP=2 with TP=1 logits.
On a machine with only a few cores TP=2 has no spare cores to gain from, and pays two all-reduces
per layer plus the control message: the figures are what was measured, nothing else. The
all-reduce latency of the group is measured too (``all-reduce``: one ``[tokens, hidden]`` sum).

Second table, the MoE choice without the communication: one MoE feed-forward (the first MoE
layer, routed experts plus the shared expert where the family has one) on ``tokens`` rows, each
rank's shard timed on one thread in this process, for the full layer (``tp1``), the column split
and expert parallelism; a split's time is its slowest rank's (the all-reduce waits for it).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from worker.model.checkpoint import load_checkpoint, read_config, weight_files
from worker.model.demo import write_demo_checkpoint
from worker.model.manifest import check_manifest
from worker.model.parallel.launch import close_active, load_tensor_parallel
from worker.model.parallel.plan import make_plan
from worker.model.parallel.shard import build_shard, load_shard_weights

OUT = Path(__file__).resolve().parent / "out"


def _checkpoint(size: str, arch: str) -> Path:
    folder = OUT / (f"demo-{size}" if arch == "sdar" else f"demo-{arch}-{size}")
    if not folder.is_dir() or check_manifest(folder):
        write_demo_checkpoint(folder, seed=0, size=size, arch=arch)  # type: ignore[arg-type]
    return folder


class Pass:
    """A prefilled cache of ``batch`` rows and the denoising-pass call on it."""

    def __init__(self, model: Any, batch: int, cache_len: int, block: int, seed: int) -> None:
        config = model.config
        gen = torch.Generator().manual_seed(seed)
        param = next(model.parameters())
        self.model = model
        self.cache = model.new_cache(max_seqs=batch, max_len=cache_len + block, device=param.device,
                                     dtype=param.dtype)
        self.slots = torch.tensor([self.cache.allocate() for _ in range(batch)])
        prefix = torch.randint(0, config.vocab_size, (batch, cache_len), generator=gen)
        pos = torch.arange(cache_len).expand(batch, -1)
        first = torch.zeros(batch, 1, dtype=torch.long)
        model(prefix, pos, pos // block, cache=self.cache, slots=self.slots,
              commit_lens=torch.full((batch,), cache_len), logits_index=first)
        self.ids = torch.randint(0, config.vocab_size, (batch, block), generator=gen)
        self.pos = cache_len + torch.arange(block).expand(batch, -1)
        self.block_ids = self.pos // block
        self.index = torch.arange(block).expand(batch, -1)
        self.counts = torch.zeros(config.num_hidden_layers, max(config.num_experts, 1), dtype=torch.long)

    def __call__(self) -> torch.Tensor:
        return self.model(self.ids, self.pos, self.block_ids, cache=self.cache, slots=self.slots,
                          commit_lens=torch.zeros(len(self.slots), dtype=torch.long),
                          router_counts=self.counts, logits_index=self.index)


def _best(calls: list[tuple[Callable[[], Any], int]], iters: int) -> list[float]:
    """Best ms of each call (run with its thread count), alternating, after one warm-up each."""
    for fn, threads in calls:
        torch.set_num_threads(threads)
        fn()
    best = [float("inf")] * len(calls)
    for _ in range(iters):
        for i, (fn, threads) in enumerate(calls):
            torch.set_num_threads(threads)
            began = time.perf_counter()
            fn()
            best[i] = min(best[i], (time.perf_counter() - began) * 1000)
    return best


def _imbalance(counts: torch.Tensor, world: int) -> float:
    """Busiest rank's routed copies over the mean, experts split in ``world`` contiguous parts."""
    moe_rows = counts[counts.sum(dim=1) > 0]  # [L', E]
    if not len(moe_rows):
        return 1.0
    per_rank = moe_rows.view(moe_rows.shape[0], world, -1).sum(dim=-1).float()  # [L', world]
    return float((per_rank.max(dim=1).values / per_rank.mean(dim=1)).mean())


def run(
    arch: str, size: str, batches: list[int], cache_len: int, block: int, iters: int
) -> list[dict[str, Any]]:
    folder = _checkpoint(size, arch)
    threads = torch.get_num_threads()
    plain = load_checkpoint(folder).model
    config = plain.config
    total, active = config.param_counts()
    print(f"{arch} {size}: {total / 1e6:.1f} M total / {active / 1e6:.1f} M active parameters, "
          f"{config.num_experts} experts top-{config.num_experts_per_tok}, float32, {threads} threads, "
          f"cache {cache_len}, block {block}, best of {iters}")
    rows: list[dict[str, Any]] = [{"batch": b} for b in batches]
    for moe in ("columns", "experts"):
        sharded = load_tensor_parallel(folder, world=2, moe=moe, verify=False,
                                       threads=max(1, threads // 2)).model
        torch.set_num_threads(threads)
        for row, batch in zip(rows, batches, strict=True):
            ref = Pass(plain, batch, cache_len, block, seed=batch)
            tp = Pass(sharded, batch, cache_len, block, seed=batch)
            calls = [(ref, threads), (tp, max(1, threads // 2))]
            if moe == "columns":
                calls.append((ref, 1))
            times = _best(calls, iters)
            torch.set_num_threads(threads)
            diff = (ref() - tp()).abs().max().item()
            key = "cols" if moe == "columns" else "ep"
            row.setdefault("tp1", times[0])
            row["tp1"] = min(row["tp1"], times[0])
            row[key] = times[1]
            row[f"diff_{key}"] = diff
            if moe == "columns":
                row["tp1_1"] = times[2]
            else:
                row["imbalance"] = _imbalance(tp.counts, 2)
            if moe == "columns":
                row["all_reduce"] = sharded.probe_all_reduce(batch * block * config.hidden_size) * 1000
        close_active()
    reduces = 2 * config.num_hidden_layers
    print(f"{'batch':>5} {'tp1/' + str(threads) + ' ms':>10} {'tp1/1 ms':>9} {'tp2 cols ms':>12} "
          f"{'tp2 ep ms':>10} {'cols/tp1':>9} {'ep/tp1':>7} {'ep imb':>7} {'all-reduce':>11} "
          f"{'max |dlogit|':>13}")
    for r in rows:
        print(f"{r['batch']:>5} {r['tp1']:>10.2f} {r['tp1_1']:>9.2f} {r['cols']:>12.2f} {r['ep']:>10.2f} "
              f"{r['tp1'] / r['cols']:>8.2f}x {r['tp1'] / r['ep']:>6.2f}x {r['imbalance']:>7.2f} "
              f"{r['all_reduce']:>8.3f} ms {max(r['diff_cols'], r['diff_ep']):>13.2e}")
    print(f"(a TP=2 forward issues {reduces} all-reduces)")
    return rows


def moe_per_rank(arch: str, size: str, tokens: list[int], iters: int) -> list[dict[str, float]]:
    """One MoE feed-forward: the whole layer vs each rank's shard of it, one thread, in-process."""
    folder = _checkpoint(size, arch)
    config = read_config(folder)
    files = weight_files(folder)
    full = load_checkpoint(folder, verify=False).model
    layer = config.moe_layers[0]
    shards = {}
    for mode in ("columns", "experts"):
        for rank in range(2):
            shard = build_shard(config, make_plan(config, rank, 2, mode), device="cpu", dtype=torch.float32,
                                reduce=lambda t: None)
            load_shard_weights(shard, files, config)
            shards[mode, rank] = shard.model.layers[layer].mlp
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    out = []
    print(f"{arch} {size}: MoE layer {layer} per rank, 1 thread, best of {iters} (ms)")
    print(f"{'tokens':>6} {'tp1':>8} {'cols r0':>8} {'cols r1':>8} {'ep r0':>8} {'ep r1':>8} "
          f"{'cols':>8} {'ep':>8} {'|cols-full|':>12}")
    for n in tokens:
        x = torch.randn(1, n, config.hidden_size, generator=gen)
        mods = [full.layers[layer].mlp, shards["columns", 0], shards["columns", 1], shards["experts", 0],
                shards["experts", 1]]
        times = _best([((lambda m=m, x=x: m(x)), 1) for m in mods], iters)
        summed = shards["columns", 0](x) + shards["columns", 1](x)
        err = (summed - mods[0](x)).abs().max().item()
        cols, ep = max(times[1:3]), max(times[3:5])
        print(f"{n:>6} {times[0]:>8.3f} {times[1]:>8.3f} {times[2]:>8.3f} {times[3]:>8.3f} {times[4]:>8.3f} "
              f"{cols:>8.3f} {ep:>8.3f} {err:>12.2e}")
        out.append(dict(tokens=n, tp1=times[0], cols=cols, ep=ep))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tp", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["clover", "sdar", "both"], default="both")
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--cache", type=int, default=512)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--moe-tokens", default="4,64,512", help="rows of the per-rank MoE table")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    threads = torch.get_num_threads()
    for arch in ("clover", "sdar") if args.arch == "both" else (args.arch,):
        run(arch, args.size, batches, args.cache, args.block, args.iters)
        print()
        moe_per_rank(arch, args.size, [int(t) for t in args.moe_tokens.split(",") if t.strip()], args.iters)
        torch.set_num_threads(threads)
        print()


if __name__ == "__main__":
    main()
