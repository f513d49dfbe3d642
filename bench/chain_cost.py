"""``python -m bench.chain_cost``: what ``train-demo --chain-blocks`` costs per step and buys in targets.

A chain (``worker.training.chain``) trains a generation row's later answer blocks by short fused
passes against its first pass's cache. This bench runs the same short stage from the shipped demo
(the sixteenth round's options: half decision rows, buckets, parallel slots; docs/demo-training.md)
with the option unset and at several lengths, on the pinned float path with two threads as the
shipped stage ran, and prints seconds per step and answer targets per step (those of the first
passes and those of the links), each as a ratio to the unset run measured here: the baseline.

Targets are counted from the steps' own batches (``_batch``, ``_noisy_batch``, ``draw_chain``
with the generator each step uses), so they are the targets those steps trained. A minute or two.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from worker.training.float_path import pin_float_path

if TYPE_CHECKING:  # the trainer is imported after the pin (its kernels must not run before it)
    from worker.training.trainer import TrainConfig


def _targets(steps: int, chain: int | None) -> tuple[float, float]:
    """Mean (first-pass targets, chained targets) per step of the stage's first ``steps`` steps."""
    from worker.model.checkpoint import load_checkpoint
    from worker.model.demo_trained import TRAINED_CLOVER_DEMO
    from worker.training.chain import draw_chain
    from worker.training.trainer import _batch, _noisy_batch

    lm = load_checkpoint(TRAINED_CLOVER_DEMO, dtype=torch.float32)
    mask = lm.config.mask_token_id
    assert mask is not None
    config = _config(steps, chain)
    first = chained = 0
    for step in range(steps):
        rows = _batch(step, config, lm.tokenizer, 4)
        gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        _, _, masked, commit, _ = _noisy_batch(rows, 4, mask, gen, True, config.parallel_slots, chain=chain)
        first += int(masked.sum())
        if chain is not None:
            chained += int(draw_chain(rows, commit, 4, mask, chain, gen).masked.sum())
    return first / steps, chained / steps


def _config(steps: int, chain: int | None) -> TrainConfig:
    from worker.model.demo_trained import TRAINED_CLOVER_DEMO
    from worker.training.trainer import TrainConfig

    return TrainConfig(arch="clover", init_from=str(TRAINED_CLOVER_DEMO), seed=3, steps=steps, batch=16,
                       lr=1e-3, served_slots=True, decision_share=0.5, decision_weight=3.0,
                       parallel_slots=1.0, buckets=2, value_share=0.5, save_every=10 * steps,
                       chain_blocks=chain)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--chains", default="4,8,16", help="comma-separated --chain-blocks values")
    args = parser.parse_args()
    pin_float_path()  # before the first kernel, as the CLI does
    torch.set_num_threads(2)
    from worker.training.trainer import train_demo

    rows = []
    for chain in [None, *(int(c) for c in args.chains.split(","))]:
        first, chained = _targets(args.steps, chain)
        with tempfile.TemporaryDirectory() as folder:
            result = train_demo(Path(folder) / "stage", _config(args.steps, chain))
        rows.append((chain, result.seconds / args.steps, first, chained))
    base_seconds, base_targets = rows[0][1], rows[0][2]
    print(f"{args.steps} steps of the shipped stage's options from the shipped demo, two threads, pinned")
    print("| --chain-blocks | s/step | x unset | targets/step: first + links | x unset |")
    print("|---|---|---|---|---|")
    for chain, seconds, first, chained in rows:
        print(f"| {chain or 'unset'} | {seconds:.3f} | {seconds / base_seconds:.2f} "
              f"| {first:.1f} + {chained:.1f} | {(first + chained) / base_targets:.2f} |")


if __name__ == "__main__":
    main()
