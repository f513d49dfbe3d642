"""``python -m bench.model``: our forward vs transformers' on the same weights and inputs.

``--arch clover`` (the default): the Clover demo checkpoint (``small``: the Qwen3.5-MoE hybrid
trunk, 6 Gated DeltaNet + 2 attention layers, ~100 M total / ~22 M active parameters) in float32;
our causal commit forward of 32 new positions per row against a committed state of 512 positions
(hybrid cache: K/V for the attention layers, ring and recurrent state for the GDN layers; the
commit is rolled back after each timed call) vs transformers' ``Qwen3_5MoeForCausalLM`` with its
own cache (a fresh copy of the 512-position cache for each timed call, copied outside the timing).

``--arch sdar``: the SDAR demo (``small``: ~86 M total / ~19 M active
parameters) in float32. For batch 1 and 16 and a block of 4 and of 32 new positions, each row has
512 committed positions in the KV cache (ours: ``KVCache``; transformers: its own
``DynamicCache``, cropped back to 512 positions after every call); the new positions form one
block that attends to the whole cache and to itself (a 4D mask for transformers). The two
forwards are timed alternately (so background load hits both alike) and the table prints the
best of ``--iters`` times per forward in milliseconds (wall clock, or process CPU time with
``--clock cpu``), the speed-up measured in this same run, and the largest logit difference
between the two as a sanity check.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from worker.model.checkpoint import load_checkpoint
from worker.model.demo import write_demo_checkpoint
from worker.model.kv_cache import KVCache
from worker.model.manifest import check_manifest

CACHE_LEN = 512
OUT = Path(__file__).resolve().parent / "out"


def _checkpoint(size: str, arch: str = "sdar") -> Path:
    folder = OUT / (f"demo-{size}" if arch == "sdar" else f"demo-{arch}-{size}")
    if not folder.is_dir() or check_manifest(folder):
        write_demo_checkpoint(folder, seed=0, size=size, arch=arch)  # type: ignore[arg-type]
    return folder


def _best_ms(
    first: Callable[[], object],
    second: Callable[[], object],
    iters: int,
    clock: Callable[[], float],
    prepare: tuple[Callable[[], object], Callable[[], object]] | None = None,
) -> tuple[float, float]:
    """Best milliseconds of each function on ``clock``, timed alternately after one warm-up call;
    ``prepare[i]`` (untimed) runs before each call of function ``i``."""
    fns = (first, second)
    for i, fn in enumerate(fns):
        if prepare:
            prepare[i]()
        fn()
    best = [float("inf"), float("inf")]
    for _ in range(iters):
        for i, fn in enumerate(fns):
            if prepare:
                prepare[i]()
            start = clock()
            fn()
            best[i] = min(best[i], (clock() - start) * 1000)
    return best[0], best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: elapsed time; cpu: process CPU time (all threads), steadier on a shared machine",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--arch", choices=["clover", "sdar"], default="clover")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers  # test/bench-only dependency

    if args.arch == "clover":
        _clover(args, transformers)
        return

    clock = time.perf_counter if args.clock == "wall" else time.process_time
    folder = _checkpoint(args.size)
    ours = load_checkpoint(folder).model
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="sdpa"
    )
    hf.eval()
    config = ours.config
    total, active = config.param_counts()
    print(
        f"checkpoint {folder.name}: {total / 1e6:.1f} M total / {active / 1e6:.1f} M active parameters, "
        f"{config.num_experts} experts top-{config.num_experts_per_tok}, float32, "
        f"{torch.get_num_threads()} threads, cache {CACHE_LEN} positions, "
        f"best of {args.iters} ({args.clock} clock)"
    )
    print(
        f"{'batch':>5} {'new':>4} {'ours ms':>9} {'transformers ms':>16} {'speed-up':>9} {'max |dlogit|':>13}"
    )
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 16):
        prefix = torch.randint(0, config.vocab_size, (batch, CACHE_LEN), generator=gen)  # [B, 512]
        prefix_pos = torch.arange(CACHE_LEN).expand(batch, -1)
        cache = KVCache(config, max_seqs=batch, max_len=CACHE_LEN + 32, device="cpu", dtype=torch.float32)
        slots = torch.tensor([cache.allocate() for _ in range(batch)])
        ours(
            prefix,
            prefix_pos,
            prefix_pos,
            cache=cache,
            slots=slots,
            commit_lens=torch.full((batch,), CACHE_LEN),
        )
        with torch.no_grad():
            hf_cache = hf(input_ids=prefix, use_cache=True).cache
        for new in (4, 32):
            ids = torch.randint(0, config.vocab_size, (batch, new), generator=gen)  # [B, N]
            run_ours, run_hf = _runners(ours, hf, ids, cache, slots, hf_cache)
            diff = (run_ours() - run_hf()).abs().max().item()
            ours_ms, hf_ms = _best_ms(run_ours, run_hf, args.iters, clock)
            print(
                f"{batch:>5} {new:>4} {ours_ms:>9.2f} {hf_ms:>16.2f} {hf_ms / ours_ms:>8.2f}x {diff:>13.2e}"
            )


def _runners(
    ours: torch.nn.Module,
    hf: torch.nn.Module,
    ids: torch.Tensor,
    cache: KVCache,
    slots: torch.Tensor,
    hf_cache: object,
) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """One forward of the block ``ids`` ``[B, N]`` after the 512 cached positions, for each model."""
    batch, new = ids.shape
    pos = torch.arange(CACHE_LEN, CACHE_LEN + new).expand(batch, -1)  # [B, N]
    block = torch.zeros_like(pos)  # one block of new positions
    hf_mask = torch.zeros(batch, 1, new, CACHE_LEN + new)  # additive: everything visible

    def run_ours() -> torch.Tensor:
        return ours(ids, pos, block, cache=cache, slots=slots)

    def run_hf() -> torch.Tensor:
        with torch.no_grad():
            out = hf(input_ids=ids, position_ids=pos, attention_mask=hf_mask, cache=hf_cache, use_cache=True)
        hf_cache.crop(-new)  # type: ignore[attr-defined]  # back to the 512 prefix
        return out.logits

    return run_ours, run_hf


def _clover(args: argparse.Namespace, transformers: Any) -> None:
    """Causal commit of 32 positions per row after 512 committed ones: ours vs transformers'."""
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    folder = _checkpoint(args.size, "clover")
    ours = load_checkpoint(folder).model
    trunk = OUT / f"trunk-clover-{args.size}"  # the same files under transformers' own model type
    if not trunk.is_dir():
        shutil.copytree(folder, trunk)
        cfg = json.loads((trunk / "config.json").read_text())
        cfg.update(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"])
        (trunk / "config.json").write_text(json.dumps(cfg))
    hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(str(trunk), dtype=torch.float32).eval()
    config = ours.config
    total, active = config.param_counts()
    print(
        f"checkpoint {folder.name}: {total / 1e6:.1f} M total / {active / 1e6:.1f} M active parameters, "
        f"{len(config.linear_layers)} GDN + {len(config.attention_layers)} attention layers, "
        f"{config.num_experts} experts top-{config.num_experts_per_tok} + shared, float32, "
        f"{torch.get_num_threads()} threads, committed {CACHE_LEN} positions, best of {args.iters} "
        f"({args.clock} clock)"
    )
    print(
        f"{'batch':>5} {'new':>4} {'ours ms':>9} {'transformers ms':>16} {'speed-up':>9} {'max |dlogit|':>13}"
    )
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 16):
        _clover_row(ours, hf, batch, 32, gen, args.iters, clock)


def _clover_row(
    ours: Any, hf: Any, batch: int, new: int, gen: torch.Generator, iters: int, clock: Callable[[], float]
) -> None:
    """One table row: ``batch`` rows committing ``new`` positions each after 512 committed ones."""
    config = ours.config
    prefix = torch.randint(0, config.vocab_size, (batch, CACHE_LEN), generator=gen)  # [B, 512]
    prefix_pos = torch.arange(CACHE_LEN).expand(batch, -1)
    cache = ours.new_cache(max_seqs=batch, max_len=CACHE_LEN + new, device="cpu", dtype=torch.float32)
    slots = torch.tensor([cache.allocate() for _ in range(batch)])
    ours(
        prefix, prefix_pos, prefix_pos, cache=cache, slots=slots, commit_lens=torch.full((batch,), CACHE_LEN)
    )
    committed = cache.snapshot(slots)
    with torch.no_grad():
        hf_prefix = hf(input_ids=prefix, use_cache=True).cache
    ids = torch.randint(0, config.vocab_size, (batch, new), generator=gen)  # [B, N]
    pos = torch.arange(CACHE_LEN, CACHE_LEN + new).expand(batch, -1)
    commit = torch.full((batch,), new)
    hf_cache: list[Any] = [None]

    def run_ours() -> torch.Tensor:
        return ours(ids, pos, pos, cache=cache, slots=slots, commit_lens=commit)

    def run_hf() -> torch.Tensor:
        with torch.no_grad():
            return hf(input_ids=ids, position_ids=pos, cache=hf_cache[0], use_cache=True).logits

    def reset_ours() -> None:
        cache.restore(slots, committed)  # the commit wrote the other state copy: roll it back

    def reset_hf() -> None:
        hf_cache[0] = copy.deepcopy(hf_prefix)

    reset_ours()
    reset_hf()
    diff = (run_ours() - run_hf()).abs().max().item()
    ours_ms, hf_ms = _best_ms(run_ours, run_hf, iters, clock, prepare=(reset_ours, reset_hf))
    print(f"{batch:>5} {new:>4} {ours_ms:>9.2f} {hf_ms:>16.2f} {hf_ms / ours_ms:>8.2f}x {diff:>13.2e}")


if __name__ == "__main__":
    main()
