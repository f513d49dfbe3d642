"""Sampler/engine benchmark on the ``small`` demo checkpoint (``python -m bench.sampler``).

``--arch clover`` (the default) runs the Clover demo (hybrid trunk + block-diffusion previews) with
Clover's decoding defaults in the throughput runs (steps = block size, dynamic, 0.95);
``--arch sdar`` the SDAR-MoE demo with static S=4.

In one run, against baselines measured in the same run:
  1. tokens/s of the engine at batch 1, 8 and 32 (continuous batching, one forward per pass),
     with the engine overhead (time outside the model forward) as a share of pass time;
  2. speed-up of the cached sampler over a plain full-recompute reference (no cache: the whole
     sequence re-run under the block-causal mask every pass, the batch's rows in one forward) at
     256 and 1024 new tokens, batch 1 and 8, greedy; at batch 1 x 256 the reference really
     decodes and its tokens are compared with the engine's; beyond, it times every k-th pass on
     the engine's final tokens and scales by k (a reference pass's cost depends on the sequence
     length only), unless ``--full``. At batch 1 on a CPU a cached pass costs about one read of
     the experts it routes to (memory bound), which caps the ratio; batching shares that read;
  3. passes per block for static and dynamic unmasking.
Goals (issue 3): speed-up >= 10x, overhead <= 10% at batch 32. On a shared CPU, wall times swing
with other load; the CPU-time speed-up (process CPU seconds, one torch thread) is the steadier figure.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from worker.engine.engine import Engine, EngineConfig
from worker.engine.reference_decode import block_logits, step_quotas
from worker.engine.types import GenerationRequest, GenerationResult, SamplingParams
from worker.model.checkpoint import LoadedModel, load_checkpoint
from worker.model.demo import write_demo_checkpoint


def _engine(lm: LoadedModel, max_batch: int, max_len: int) -> Engine:
    engine = Engine(
        lm.model,
        EngineConfig(max_batch=max_batch, max_len=max_len, max_tokens_in_flight=max_batch * max_len),
        mask_token_id=lm.config.mask_token_id,
        eos_token_ids=(),  # random weights: never stop early, so every run decodes the same length
        default_block_size=lm.config.block_size,
    )
    engine.start()
    return engine


def _prompt(i: int, n: int, vocab: int, mask: int) -> list[int]:
    ids = [(31 * i + 7 * j + 1) % vocab for j in range(n)]
    return [t if t != mask else t - 1 for t in ids]


def throughput(lm: LoadedModel, batch: int, new_tokens: int, params: SamplingParams) -> dict[str, float]:
    """Tokens/s and overhead share with ``batch`` requests decoded together."""
    engine = _engine(lm, batch, 64 + new_tokens + 16)
    cfg = lm.config
    try:
        engine.warm_up()
        before = engine.stats()
        began = time.perf_counter()
        futures = [
            engine.submit(
                GenerationRequest(f"b{i}", _prompt(i, 32, cfg.vocab_size, cfg.mask_token_id), params)
            )
            for i in range(batch)
        ]
        results = [f.result() for f in futures]
        wall = time.perf_counter() - began
        after = engine.stats()
    finally:
        engine.stop()
    busy = after.busy_seconds - before.busy_seconds
    forward = after.forward_seconds - before.forward_seconds
    tokens = sum(r.tokens for r in results)
    return {
        "tokens_per_s": tokens / wall,
        "overhead": 1.0 - forward / busy if busy > 0 else 0.0,
        "passes": after.passes - before.passes,
        "pass_ms": 1000 * busy / max(after.passes - before.passes, 1),
    }


def reference_decode(
    lm: LoadedModel,
    prompts: list[list[int]],
    new_tokens: int,
    block: int,
    steps: int,
    *,
    stride: int = 1,
    finals: list[list[int]] | None = None,
) -> tuple[list[list[int]], float, float, int]:
    """Greedy static decoding of equally long prompts with full recompute, the rows batched in
    one forward per pass; returns (tokens per row, wall s, CPU s, passes timed).

    ``worker/engine/reference_decode.py`` is the contract's readable loop for one sequence; this
    is the same loop (its ``block_logits`` and ``step_quotas``) batched over rows so that the bench
    times work equal to the engine's batched passes. The tests hold its rows equal to the readable
    reference's tokens.

    With ``stride`` > 1 only every ``stride``-th pass is run (on ``finals``' tokens, with the
    current block masked) and the time is scaled up accordingly.
    """
    mask = lm.config.mask_token_id
    start = len(prompts[0])
    assert all(len(p) == start for p in prompts), "the reference batches equally long prompts"
    end = -(-(start + new_tokens) // block) * block
    seqs = torch.tensor([list(p) + [mask] * (end - start) for p in prompts])  # [B, end]
    seconds, cpu, index, timed = 0.0, 0.0, 0, 0
    for b in range(start // block, end // block):
        lo, hi = b * block, (b + 1) * block
        first = max(lo, start)
        for quota in step_quotas(hi - first, steps):
            index += 1
            if stride > 1:
                if index % stride:
                    continue
                assert finals is not None
                for row, final in enumerate(finals):
                    done = torch.tensor(final[: end - start] + [mask] * (end - start - len(final)))
                    seqs[row, start:] = done
                seqs[:, first:hi] = mask
            began, began_cpu = time.perf_counter(), time.process_time()
            logits = block_logits(lm.model, seqs, lo, hi, block)[:, first - lo :]  # [B, m, V]
            logits[..., mask] = float("-inf")
            conf, tok = torch.softmax(logits, dim=-1).max(dim=-1)  # [B, m]
            open_ = seqs[:, first:hi] == mask  # [B, m]
            keyed = conf.masked_fill(~open_, float("-inf"))
            order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices  # [B, m]
            for row in range(len(prompts)):
                take = order[row, : min(quota, int(open_[row].sum()))]
                seqs[row, first + take] = tok[row, take]
            seconds += time.perf_counter() - began
            cpu += time.process_time() - began_cpu
            timed += 1
    tokens = [row[start : start + new_tokens] for row in seqs.tolist()]
    return tokens, seconds * stride, cpu * stride, timed


def speedup(lm: LoadedModel, new_tokens: int, batch: int, full: bool) -> dict[str, float | bool | int]:
    """The cached engine vs the batched full-recompute reference on ``batch`` prompts of 16."""
    block = lm.config.block_size or 8
    steps = 4
    cfg = lm.config
    prompts = [_prompt(i, 16, cfg.vocab_size, cfg.mask_token_id) for i in range(batch)]
    engine = _engine(lm, batch, 16 + new_tokens + block)
    try:
        engine.warm_up()
        params = SamplingParams(max_new_tokens=new_tokens, steps_per_block=steps, strategy="static")
        passes_before = engine.stats().passes
        began, began_cpu = time.perf_counter(), time.process_time()
        futures = [engine.submit(GenerationRequest(f"s{i}", p, params)) for i, p in enumerate(prompts)]
        results: list[GenerationResult] = [f.result() for f in futures]
        cached = time.perf_counter() - began
        cached_cpu = time.process_time() - began_cpu  # the engine thread's work (the caller waits idle)
        cached_passes = engine.stats().passes - passes_before
    finally:
        engine.stop()
    # The reference's passes cost ~batch x (prompt + tokens so far) positions each: time a
    # sample of them beyond the sizes where running all of them is quick.
    work = batch * new_tokens
    stride = 1 if full or work <= 256 else (8 if work <= 2048 else 32)
    finals = [r.token_ids for r in results]
    tokens, ref_seconds, ref_cpu, timed = reference_decode(
        lm, prompts, new_tokens, block, steps, stride=stride, finals=finals
    )
    out: dict[str, float | bool | int] = {
        "cached_s": cached,
        "reference_s": ref_seconds,
        "speedup": ref_seconds / cached,
        "cpu_speedup": ref_cpu / cached_cpu,
        "cached_cpu_ms_per_pass": 1000 * cached_cpu / max(cached_passes, 1),
        "reference_cpu_ms_per_pass": 1000 * ref_cpu / stride / max(timed, 1),  # per pass actually run
        "stride": stride,
        "timed_passes": timed,
    }
    if stride == 1:
        out["tokens_equal"] = tokens == finals
    return out


def passes_per_block(lm: LoadedModel) -> dict[str, float]:
    cfg = lm.config
    engine = _engine(lm, 8, 256)
    rows: dict[str, float] = {}
    try:
        for name, params in {
            "family defaults": SamplingParams(max_new_tokens=64),
            "static S=4": SamplingParams(max_new_tokens=64, steps_per_block=4, strategy="static"),
            "static S=8": SamplingParams(max_new_tokens=64, steps_per_block=8, strategy="static"),
            "dynamic S=8 thr=0.9": SamplingParams(
                max_new_tokens=64, steps_per_block=8, strategy="dynamic", threshold=0.9
            ),
            "dynamic S=8 thr=0.3": SamplingParams(
                max_new_tokens=64, steps_per_block=8, strategy="dynamic", threshold=0.3
            ),
            "dynamic S=8 thr=0.1": SamplingParams(
                max_new_tokens=64, steps_per_block=8, strategy="dynamic", threshold=0.1
            ),
        }.items():
            futures = [
                engine.submit(
                    GenerationRequest(f"p{i}", _prompt(i, 24, cfg.vocab_size, cfg.mask_token_id), params)
                )
                for i in range(8)
            ]
            results = [f.result() for f in futures]
            rows[name] = sum(r.steps_used for r in results) / sum(r.blocks for r in results)
    finally:
        engine.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="Default: a fresh small demo checkpoint."
    )
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--arch", choices=["clover", "sdar", "llada2"], default="clover")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--new-tokens", type=int, default=64, help="Per request in the throughput runs.")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--lengths", default="256,1024", help="New tokens for the speed-up runs.")
    parser.add_argument(
        "--speedup-batches", default="1,8",
        help="Batch sizes of the speed-up runs (the reference batches its rows in one forward too).",
    )
    parser.add_argument("--full", action="store_true", help="Run every reference pass, even at 1024.")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1 keeps a shared CPU stable; 0: torch's).",
    )
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.checkpoint or write_demo_checkpoint(
            Path(tmp) / args.size, seed=0, size=args.size, arch=args.arch
        )
        lm = load_checkpoint(folder, device=args.device, dtype=getattr(torch, args.dtype))
    c = lm.config
    total, active = c.param_counts()
    print(
        f"checkpoint: {args.checkpoint or args.size} "
        f"({total / 1e6:.1f} M params, {active / 1e6:.1f} M active), "
        f"device {args.device}, {args.dtype}, torch threads {torch.get_num_threads()}, block {c.block_size}, "
        f"family {c.family}"
    )

    if c.family == "clover":  # the family's defaults: S = block size, dynamic, threshold 0.95
        params, decoding = SamplingParams(max_new_tokens=args.new_tokens), f"dynamic 0.95 S={c.block_size}"
    else:
        params = SamplingParams(max_new_tokens=args.new_tokens, steps_per_block=4, strategy="static")
        decoding = "static S=4"
    print(f"\n[1] throughput: prompt 32, {args.new_tokens} new tokens/request, {decoding}, greedy")
    print(f"{'batch':>6} {'tokens/s':>10} {'x batch 1':>10} {'passes':>7} {'ms/pass':>8} {'overhead':>9}")
    base = None
    for batch in (int(b) for b in args.batches.split(",")):
        r = throughput(lm, batch, args.new_tokens, params)
        base = base or r["tokens_per_s"]
        print(
            f"{batch:>6} {r['tokens_per_s']:>10.1f} {r['tokens_per_s'] / base:>9.2f}x {r['passes']:>7.0f} "
            f"{r['pass_ms']:>8.1f} {100 * r['overhead']:>8.1f}%"
        )

    print("\n[2] cached engine vs full-recompute reference: prompts of 16, static S=4, greedy")
    print(
        f"{'batch':>5} {'new':>5} {'cached s':>9} {'reference s':>12} {'speed-up':>9} {'CPU-time':>9} "
        f"{'CPU ms/pass':>11} {'ref CPU ms/pass':>15}  note"
    )
    for batch in (int(b) for b in args.speedup_batches.split(",")):
        for n in (int(x) for x in args.lengths.split(",")):
            r = speedup(lm, n, batch, args.full)
            note = (
                f"tokens equal: {r['tokens_equal']}"
                if "tokens_equal" in r
                else f"reference timed on 1/{r['stride']} of its passes ({r['timed_passes']}), scaled"
            )
            print(
                f"{batch:>5} {n:>5} {r['cached_s']:>9.2f} {r['reference_s']:>12.2f} {r['speedup']:>8.1f}x "
                f"{r['cpu_speedup']:>8.1f}x {r['cached_cpu_ms_per_pass']:>11.1f} "
                f"{r['reference_cpu_ms_per_pass']:>15.1f}  {note}"
            )

    print("\n[3] passes per block (8 requests, 64 new tokens, greedy)")
    for name, value in passes_per_block(lm).items():
        print(f"  {name:<22} {value:.2f}")


if __name__ == "__main__":
    main()
