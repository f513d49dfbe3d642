"""Long prompts on a demo checkpoint (``python -m bench.long``), issue 26.

  1. **Prefill cost by length**: a prompt of 1K, 4K, 16K and 32K tokens prefilled through the
     engine's commit forward in the chunks the engine cuts for a ``--chunk``-token budget (and, beside
     them, in fixed ``--chunk``-token chunks: the budget counted in tokens), for the
     Clover hybrid (Gated DeltaNet in 3 of 4 layers: constant state) and, for contrast, SDAR (every
     layer attention). Printed: time per prompt token, its ratio to the 1K figure (goal for Clover:
     32K within 2x of 1K), and the process's peak resident memory after each length (lengths run
     in increasing order, so each peak is that length's).
  2. **Short jobs under long prefills**: 8-token jobs arriving every ``--short-every`` seconds on
     an engine that is otherwise idle (the baseline), then while ``--long`` -token prompts arrive
     one after another, with chunked prefill off and on (``--chunk`` tokens per iteration). Printed:
     p50/p95 wait (submit to the start of the job's first denoising pass: the engine's
     ``queue_seconds``) and latency (submit to result) of the short jobs, and the goal of issue 26:
     wait p95 under long prefills <= 1.5x the idle wait p95 + one pass at the budget (the measured
     time of one chunk as the engine cuts it halfway into a long prompt). The budget is work
     (``worker/engine/prefill_chunks.py``): ``--chunk`` tokens at a prompt's start, fewer deeper in,
     so the chunks at the start and near the end, printed beside it, should cost the same; the
     long prompt's own prefill with these chunks and with fixed ``--chunk``-token chunks is printed
     too (what the work budget costs it). Latency shows the price: each of a short job's passes
     shares its iteration with up to one chunk.

     The wait used to end at admission into the running batch, which came before the iteration's
     chunk (and, for a prompt that did not fit what the budget had left, before every chunk of
     the long prompt): it hid up to a whole long prefill. Figures before that change and after it
     do not compare.

Everything runs in this one process on this machine (CPU unless ``--device``); the baseline of
each ratio is measured in the same run.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from worker.engine.engine import Engine, EngineConfig
from worker.engine.prefill_chunks import budget_work, chunk_spans, whole_block_chunk
from worker.engine.runner import PassTimings
from worker.engine.types import GenerationRequest, SamplingParams
from worker.model.checkpoint import load_checkpoint
from worker.model.config import ModelConfig
from worker.model.demo import write_demo_checkpoint

LENGTHS = (1024, 4096, 16384, 32768)
SHORT_JOBS_BATCH = 32  # engine slots in part 2: never the limit (16 were, under 16K-token prompts)


class LoadedModel(Protocol):
    """What these measurements read of a model: a checkpoint's (``worker.model.checkpoint``) or
    one built on the device with random weights (``bench.gpu_clover``)."""

    @property
    def model(self) -> Any: ...

    @property
    def config(self) -> ModelConfig: ...


def _block(lm: LoadedModel) -> int:
    block = lm.config.block_size
    assert block is not None, "a demo checkpoint names its block size"
    return block


def _mask(lm: LoadedModel) -> int:
    mask = lm.config.mask_token_id
    assert mask is not None, "a demo checkpoint names its mask token"
    return mask


def _prompt(lm: LoadedModel, length: int, salt: int = 0) -> list[int]:
    vocab, mask = lm.config.vocab_size, _mask(lm)
    ids = [(13 * j + 7 * salt + 5) % vocab for j in range(length)]
    return [t if t != mask else (t + 1) % vocab for t in ids]


def _engine(lm: LoadedModel, *, max_len: int, chunk: int, max_batch: int = 8,
            token_work_keys: int = 0) -> Engine:
    engine = Engine(lm.model, EngineConfig(max_batch=max_batch, max_len=max_len, prefix_cache_bytes=0,
                                           prefill_chunk_tokens=chunk, token_work_keys=token_work_keys),
                    mask_token_id=_mask(lm), eos_token_ids=(), default_block_size=_block(lm))
    return engine


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def prefill_costs(lm: LoadedModel, lengths: tuple[int, ...],
                  chunk: int) -> list[tuple[int, float, float, float]]:
    """(length, seconds per prompt token with the engine's chunks, the same with fixed ``chunk``-token
    chunks, peak RSS MiB) per length: one prompt prefilled chunk by chunk into one engine slot (the
    engine thread is not started: the runner is driven directly). The engine's chunks carry
    ``chunk`` tokens' work (``prefill_chunks``): fewer tokens deeper in, each forward paying its
    fixed cost; ``W`` is measured first, as a worker's engine does when it starts."""
    block = _block(lm)
    engine = _engine(lm, max_len=max(lengths) + 2 * block, chunk=chunk, max_batch=1)
    engine.calibrate()
    rows = []

    def per_token(prompt: list[int], spans: list[tuple[int, int]]) -> float:
        slot = engine.cache.allocate()
        began = time.perf_counter()
        for at, to in spans:
            engine.runner.run_prefill(slot, prompt[at:to], at, block, PassTimings())
        seconds = time.perf_counter() - began
        engine.cache.free(slot)
        return seconds / len(prompt)

    with torch.inference_mode():
        warm = engine.cache.allocate()  # one untimed chunk: the first length does not pay the warm-up
        engine.runner.run_prefill(warm, _prompt(lm, chunk, salt=5), 0, block, PassTimings())
        engine.cache.free(warm)
        for length in lengths:
            prompt = _prompt(lm, length)
            fixed = per_token(prompt, [(at, min(at + chunk, length)) for at in range(0, length, chunk)])
            cut = per_token(prompt, chunk_spans(0, length, block, chunk, engine.runner.forward_cost))
            rows.append((length, cut, fixed, _peak_mib()))
    return rows


@dataclass(frozen=True)
class ChunkCosts:
    """What the engine's work budget does to one long prompt (``prefill_chunks``): the per-token
    work ``W`` its runner measured, the prompt's prefill with chunks of a fixed ``--chunk`` tokens
    (the budget counted in tokens) and with the engine's work-sized chunks, and the time of one
    work-sized chunk at the prompt's start, halfway and near its end."""

    token_keys: int
    token_chunks: tuple[int, float]  # (forwards, seconds) with fixed-size chunks
    work_chunks: tuple[int, float]  # (forwards, seconds) with the engine's chunks
    forward_at: dict[str, tuple[int, float]]  # where -> (chunk tokens, median seconds)


def chunk_costs(lm: LoadedModel, chunk: int, long: int) -> ChunkCosts:
    """Measure ``W`` as a starting engine does, then prefill one ``long``-token prompt twice: in
    fixed ``chunk``-token chunks and as the engine cuts it; then time the engine's chunks at three
    depths (median of 3 each)."""
    block = _block(lm)
    engine = _engine(lm, max_len=long + 4 * chunk, chunk=chunk, max_batch=1)
    engine.calibrate()
    runner = engine.runner
    prompt = _prompt(lm, long + 3 * chunk, salt=3)

    def prefill(spans: list[tuple[int, int]]) -> tuple[int, float]:
        slot = engine.cache.allocate()
        began = time.perf_counter()
        for at, to in spans:
            runner.run_prefill(slot, prompt[at:to], at, block, PassTimings())
        seconds = time.perf_counter() - began
        engine.cache.free(slot)
        return len(spans), seconds

    with torch.inference_mode():
        fixed = prefill([(at, min(at + chunk, long)) for at in range(0, long, chunk)])
        cost = runner.forward_cost
        engine_spans = chunk_spans(0, long, block, chunk, cost)
        work = prefill(engine_spans)
        forward_at = {}
        for where, context in (("start", 0), ("halfway", long // 2), ("near the end", long - block)):
            tokens = whole_block_chunk(budget_work(chunk, cost), context, block, cost, at_least_one=True)
            slot = engine.cache.allocate()
            for at, to in chunk_spans(0, context, block, chunk, cost):  # reach the depth (untimed)
                runner.run_prefill(slot, prompt[at:to], at, block, PassTimings())
            times = []
            for _ in range(3):  # the same chunk three times over the same prefix
                before = engine.cache.snapshot(torch.tensor([slot]))
                began = time.perf_counter()
                runner.run_prefill(slot, prompt[context:context + tokens], context, block, PassTimings())
                times.append(time.perf_counter() - began)
                engine.cache.restore(torch.tensor([slot]), before)
            engine.cache.free(slot)
            forward_at[where] = (tokens, statistics.median(times))
    return ChunkCosts(cost.token_keys, fixed, work, forward_at)


def short_jobs(lm: LoadedModel, *, chunk: int, long_tokens: int, shorts: int, every: float,
               with_long: bool, token_work_keys: int = 0) -> tuple[list[float], list[float]]:
    """(waits, latencies) in seconds of ``shorts`` 8-token jobs, one every ``every`` s, with long
    prompts arriving one after another meanwhile (``with_long``) or not. The wait is submit to the
    start of the job's first denoising pass, the latency submit to result, both on the engine's
    own clock. ``token_work_keys``: the engine's ``W`` (0: it measures its own when it starts)."""
    engine = _engine(lm, max_len=long_tokens + 64, chunk=chunk, max_batch=SHORT_JOBS_BATCH,  # never the limit
                     token_work_keys=token_work_keys)
    engine.start()
    stop = threading.Event()

    def long_stream() -> None:
        salt = 0
        while not stop.is_set():
            salt += 1
            request = GenerationRequest(f"long{salt}", _prompt(lm, long_tokens, salt),
                                        SamplingParams(max_new_tokens=_block(lm)))
            engine.submit(request).result()

    feeder = threading.Thread(target=long_stream, daemon=True) if with_long else None
    try:
        if feeder is not None:
            feeder.start()
            time.sleep(every)  # the first long prompt is prefilling
        futures = []
        for i in range(shorts):
            params = SamplingParams(max_new_tokens=8)
            futures.append(engine.submit(GenerationRequest(f"short{i}", _prompt(lm, 12, 1000 + i), params)))
            time.sleep(every)
        results = [future.result() for future in futures]
    finally:
        stop.set()
        if feeder is not None:
            feeder.join()
        engine.stop()
    return [r.queue_seconds for r in results], [r.queue_seconds + r.run_seconds for r in results]


def dense_pass_bytes(lm: LoadedModel, *, rows: int, tokens: int) -> int:
    """Memory the dense attention mask of one unchunked pass can take: ``rows`` rows padded to a
    ``tokens``-token prompt (a short job's first pass counts as long in the runner's split rule, so
    every row may be padded), each ``T x S`` positions holding the boolean mask and its complement
    (1 byte each) plus the additive bias before and after repeating it for the ``G`` query heads of
    a KV head (``worker/model/mask.py``). Chunked prefill never builds it: its passes carry one
    chunk, and a chunk alone attends with no mask over the prefix (``worker/model/attend.py``)."""
    width = tokens + 2 * _block(lm)  # T = S: the prompt's blocks and the block being decoded
    elem = torch.empty((), dtype=lm.model.embed.weight.dtype).element_size()
    return rows * width * width * (2 + elem * (1 + lm.config.kv_groups))


def _available_bytes() -> int | None:
    """MemAvailable of this machine (Linux), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chunk", type=int, default=512, help="Prefill tokens per iteration.")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--long", type=int, default=4096,
                        help="Tokens of the long prompts in part 2 (the unchunked run is skipped, with the "
                        "memory it needs, where a pass padded to them would not fit: a 16K-token prompt was "
                        "OOM-killed on a 24 GB machine).")
    parser.add_argument("--shorts", type=int, default=40, help="Short jobs per run in part 2.")
    parser.add_argument("--short-every", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's).")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    lengths = tuple(int(x) for x in args.lengths.split(",") if x.strip())  # empty: skip part 1
    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("clover", "sdar"):
            folder = write_demo_checkpoint(Path(tmp) / arch, seed=0, size=args.size, arch=arch)
            models[arch] = load_checkpoint(folder, device=args.device)
    print(f"demo size {args.size}, device {args.device}, torch threads {torch.get_num_threads()}, "
          f"chunk {args.chunk} tokens")

    print("\n[1] prefill cost by prompt length (chunked commit forwards: the engine's chunks; fixed "
          f"{args.chunk}-token chunks beside them)")
    print(f"{'family':>7} {'tokens':>7} {'us/token':>9} {'vs 1K':>6} {'fixed us/token':>15} {'vs 1K':>6} "
          f"{'peak RSS MiB':>13}")
    for arch, lm in models.items() if lengths else ():
        rows = prefill_costs(lm, lengths, args.chunk)
        first, first_fixed = rows[0][1], rows[0][2]
        for length, per_token, fixed, peak in rows:
            print(f"{arch:>7} {length:>7} {per_token * 1e6:>9.1f} {per_token / first:>5.2f}x "
                  f"{fixed * 1e6:>15.1f} {fixed / first_fixed:>5.2f}x {peak:>13.0f}")

    lm = models["clover"]
    costs = chunk_costs(lm, args.chunk, args.long)
    one_pass = costs.forward_at["halfway"][1]  # the goal's pass at the budget: halfway into the prompt
    print(f"\n[2] Clover: {args.shorts} 8-token jobs every {args.short_every * 1000:.0f} ms; long prompts "
          f"of {args.long} tokens one after another")
    print(f"the budget: {args.chunk} tokens at a prompt's start, counted as work; measured W = "
          f"{costs.token_keys} keys per token. One chunk as the engine cuts it: "
          + ", ".join(f"{where} {tokens} tokens {seconds * 1000:.1f} ms"
                      for where, (tokens, seconds) in costs.forward_at.items()))
    (n_fixed, t_fixed), (n_work, t_work) = costs.token_chunks, costs.work_chunks
    print(f"one {args.long}-token prefill: {n_work} work-sized chunks {t_work:.2f} s, {n_fixed} chunks of "
          f"{args.chunk} tokens {t_fixed:.2f} s ({t_work / t_fixed:.2f}x: what the long prompt pays)")
    # unchunked, a pass of up to max_batch rows padded to the long prompt builds the dense mask:
    # run it only where it fits (a 16K-token prompt on the tiny demo was OOM-killed on 24 GB)
    needed, available = dense_pass_bytes(lm, rows=SHORT_JOBS_BATCH, tokens=args.long), _available_bytes()
    runs = {
        "idle": short_jobs(lm, chunk=args.chunk, long_tokens=args.long, shorts=args.shorts,
                           every=args.short_every, with_long=False, token_work_keys=costs.token_keys),
    }
    if available is None or needed <= available // 2:
        runs["long prefills, unchunked"] = short_jobs(lm, chunk=0, long_tokens=args.long, shorts=args.shorts,
                                                      every=args.short_every, with_long=True)
    # the W measured above: the goal's pass is one chunk of the engine measured
    runs["long prefills, chunked"] = short_jobs(lm, chunk=args.chunk, long_tokens=args.long,
                                                shorts=args.shorts, every=args.short_every, with_long=True,
                                                token_work_keys=costs.token_keys)
    idle_wait = _p(runs["idle"][0], 0.95)
    print(f"{'run':>25} {'wait p50 ms':>12} {'wait p95 ms':>12} {'latency p50 ms':>15} "
          f"{'latency p95 ms':>15}")
    for name, (waits, latencies) in runs.items():
        print(f"{name:>25} {_p(waits, 0.5) * 1000:>12.1f} {_p(waits, 0.95) * 1000:>12.1f} "
              f"{_p(latencies, 0.5) * 1000:>15.1f} {_p(latencies, 0.95) * 1000:>15.1f}")
    if "long prefills, unchunked" not in runs:
        print(f"{'long prefills, unchunked':>25} skipped: needs {needed / 1e9:.1f} GB (a pass of "
              f"{SHORT_JOBS_BATCH} rows padded to {args.long} tokens, dense mask), "
              f"{(available or 0) / 1e9:.1f} GB available (runs where it is at most half)")
    goal = 1.5 * idle_wait + one_pass
    chunked = _p(runs["long prefills, chunked"][0], 0.95)
    print(f"goal: chunked wait p95 <= 1.5 x idle wait p95 + one pass = {goal * 1000:.1f} ms: "
          f"{'met' if chunked <= goal else 'MISSED'} ({chunked * 1000:.1f} ms)", end="")
    if "long prefills, unchunked" in runs:
        unchunked = _p(runs["long prefills, unchunked"][0], 0.95)
        print(f"; unchunked wait p95 {unchunked * 1000:.1f} ms "
              f"({unchunked / max(chunked, 1e-9):.1f}x the chunked)")
    else:
        print()


if __name__ == "__main__":
    main()
