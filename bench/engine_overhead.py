"""Engine overhead per pass on a demo checkpoint (``python -m bench.engine_overhead``).

Issue 20: every engine pass built ~16 host tensors and synced the host several times. This bench
runs the real engine (``worker.engine.Engine``: admission, ``SequenceState``, ``ModelRunner``, the
sampler) on a fresh demo checkpoint at batch 1 and batch 32 and reports, per engine iteration
(one denoising pass over every active sequence, plus the admission/retire bookkeeping around it):

  total    time of the iteration (``--clock cpu``, the default: this thread's CPU time, which
           a shared machine's load disturbs far less than wall time; ``wall`` on a GPU),
  forward  time inside the model forwards,
  outside  total - forward: the engine's own work (input building, sampling and commit glue,
           host transfers, sequence bookkeeping),
  syncs    host syncs per pass outside the forward (``.tolist()``/``.item()``/``.cpu()``/
           ``bool()``/``int()``/``float()`` of a tensor, ``torch.cuda.synchronize``; on CPU these
           are the calls that would sync on a GPU)
           and inside it (the model's own, e.g. the cache view's lengths),
  host tensors  ``torch.tensor``/``torch.as_tensor``/``torch.from_numpy`` calls per pass outside
           the forward,
  vocab temps  aten ops per pass outside the forward whose result has the vocabulary as its last
           dimension (fresh vocab-sized tensors; in-place ops and views excluded), and their KiB.

The engine is driven in this thread (``Engine._next_iteration``, the engine thread's loop body) so
each iteration is timed on its own; every request is queued before the first iteration, so the
first one admits the whole batch and fuses its prefill. Timings come from ``--reps`` repetitions
of the same workload (after one warm-up repetition) and are medians over all passes; counts come
from one extra, instrumented repetition (the counting hooks cost time, so they never run while
timing). Torch runs ``--threads`` intra-op threads (default 1: the figures are steadier on a
shared machine).

Rows decode greedily (``--sampling greedy``), with a seeded temperature/top-p draw (``seeded``),
or half and half (``mixed``, the default). ``tokens`` is a digest of every output token of every
repetition: two runs (e.g. before and after an engine change) decode identically iff it matches.
``--json PATH`` writes the figures; ``--against PATH`` prints them next to a saved run's (the
"before" column) with the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from worker.engine.engine import Engine, EngineConfig
from worker.engine.types import GenerationRequest, SamplingParams
from worker.model.checkpoint import LoadedModel, load_checkpoint
from worker.model.demo import write_demo_checkpoint

# ``.numpy()`` is not counted: it only works on a CPU tensor, where it is a view (no transfer)
_SYNC_METHODS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__")
_BUILDERS = ("tensor", "as_tensor", "from_numpy")


class _Counts:
    """Counters of one instrumented repetition (engine thread only: this one)."""

    def __init__(self) -> None:
        self.in_forward = 0  # > 0 while a model forward runs
        self.syncs_outside = 0
        self.syncs_inside = 0
        self.host_tensors = 0
        self.vocab_temps = 0
        self.vocab_bytes = 0


class _VocabTemps(TorchDispatchMode):
    """Counts ops outside the forward whose fresh (non-view, out-of-place) result ends in ``vocab``."""

    def __init__(self, counts: _Counts, vocab: int) -> None:
        super().__init__()
        self.counts, self.vocab = counts, vocab

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.counts.in_forward == 0 and isinstance(out, torch.Tensor) and out.dim() > 0:
            schema = func._schema
            inplace = schema.name.endswith("_") or any(
                a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
            )
            view = any(r.alias_info is not None for r in schema.returns)
            if out.shape[-1] == self.vocab and not inplace and not view:
                self.counts.vocab_temps += 1
                self.counts.vocab_bytes += out.numel() * out.element_size()
        return out


@contextlib.contextmanager
def _instrumented(engine: Engine, counts: _Counts) -> Iterator[None]:
    """Count host syncs and host-tensor builds (inside vs outside the model forward)."""
    me = threading.get_ident()
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, counter: Callable[[], None]) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == me:
                counter()
            return original(*args, **kwargs)

        saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    def sync() -> None:
        if counts.in_forward:
            counts.syncs_inside += 1
        else:
            counts.syncs_outside += 1

    def built() -> None:
        if not counts.in_forward:
            counts.host_tensors += 1

    for name in _SYNC_METHODS:
        patch(torch.Tensor, name, sync)
    patch(torch.cuda, "synchronize", sync)
    for name in _BUILDERS:
        patch(torch, name, built)
    model = engine.model
    original_forward = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        counts.in_forward += 1
        try:
            return original_forward(*args, **kwargs)
        finally:
            counts.in_forward -= 1

    model.forward = forward
    try:
        yield
    finally:
        del model.forward
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _requests(
    lm: LoadedModel, batch: int, rep: int, new_tokens: int, sampling: str
) -> list[GenerationRequest]:
    """``batch`` prompts of 12..35 tokens (deterministic per repetition), decoding ``new_tokens``."""
    c = lm.config
    pool = [t for t in range(c.vocab_size) if t != c.mask_token_id]
    gen = torch.Generator().manual_seed(1000 + rep)
    out = []
    for i in range(batch):
        n = 12 + (7 * i + rep) % 24
        prompt = [pool[j] for j in torch.randint(len(pool), (n,), generator=gen).tolist()]
        seeded = sampling == "seeded" or (sampling == "mixed" and i % 2 == 1)
        params = (
            SamplingParams(max_new_tokens=new_tokens, temperature=0.8, top_p=0.9, seed=rep * 1000 + i)
            if seeded
            else SamplingParams(max_new_tokens=new_tokens)
        )
        out.append(GenerationRequest(f"r{rep}-{i}", prompt, params))
    return out


@contextlib.contextmanager
def _timed_forward(engine: Engine, clock: Callable[[], float], spent: list[float]) -> Iterator[None]:
    """Add the ``clock`` time of every model forward to ``spent[0]``."""
    model = engine.model
    original_forward = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        began = clock()
        try:
            return original_forward(*args, **kwargs)
        finally:
            spent[0] += clock() - began

    model.forward = forward
    try:
        yield
    finally:
        del model.forward


def _drive(engine: Engine, requests: list[GenerationRequest], samples: list[tuple[float, float]] | None,
           digest: Any, clock: Callable[[], float] = time.perf_counter) -> int:
    """Queue ``requests`` and run engine iterations in this thread until they are all done;
    ``samples`` gets (iteration, forward) times per iteration on ``clock``."""
    futures = engine.submit_many(requests)
    passes = 0
    spent = [0.0]
    with _timed_forward(engine, clock, spent) if samples is not None else contextlib.nullcontext():
        while engine._waiting or engine._active:
            began, spent[0] = clock(), 0.0
            engine._next_iteration()
            if samples is not None:
                samples.append((clock() - began, spent[0]))
            passes += 1
    for f in futures:
        result = f.result(timeout=0)
        if result.error:
            raise RuntimeError(result.error)
        digest.update(repr(result.token_ids).encode())
    return passes


def measure(
    lm: LoadedModel, batch: int, reps: int, new_tokens: int, sampling: str, clock: Callable[[], float]
) -> dict[str, Any]:
    """Median per-pass figures of ``reps`` repetitions, plus one instrumented repetition's counts."""
    engine = Engine(
        lm.model,
        EngineConfig(max_batch=batch, max_len=256, max_tokens_in_flight=batch * 256),
        mask_token_id=int(lm.config.mask_token_id or 0),
        eos_token_ids=(),  # random weights: decode the whole region every time
        default_block_size=lm.config.block_size,
    )
    digest = hashlib.sha256()
    _drive(engine, _requests(lm, batch, 0, new_tokens, sampling), None, hashlib.sha256())  # warm-up
    samples: list[tuple[float, float]] = []
    for rep in range(1, reps + 1):
        _drive(engine, _requests(lm, batch, rep, new_tokens, sampling), samples, digest, clock)
    counts = _Counts()
    requests = _requests(lm, batch, 1, new_tokens, sampling)  # built outside the counting
    with _instrumented(engine, counts), _VocabTemps(counts, lm.config.vocab_size):
        passes = _drive(engine, requests, None, hashlib.sha256())
    totals = [s[0] for s in samples]
    forwards = [s[1] for s in samples]
    return {
        "passes": len(samples),
        "total_ms": statistics.median(totals) * 1e3,
        "forward_ms": statistics.median(forwards) * 1e3,
        "outside_ms": statistics.median(t - f for t, f in samples) * 1e3,
        "outside_mean_ms": (sum(totals) - sum(forwards)) / len(samples) * 1e3,
        "syncs_outside": counts.syncs_outside / passes,
        "syncs_inside": counts.syncs_inside / passes,
        "host_tensors": counts.host_tensors / passes,
        "vocab_temps": counts.vocab_temps / passes,
        "vocab_kib": counts.vocab_bytes / passes / 1024,
        "tokens": digest.hexdigest()[:12],
    }


_COLUMNS = (
    ("total_ms", "total ms", 9, ".3f"),
    ("forward_ms", "forward ms", 10, ".3f"),
    ("outside_ms", "outside ms", 10, ".3f"),
    ("syncs_outside", "syncs out", 9, ".2f"),
    ("syncs_inside", "syncs in", 8, ".2f"),
    ("host_tensors", "host tensors", 12, ".2f"),
    ("vocab_temps", "vocab temps", 11, ".2f"),
    ("vocab_kib", "vocab KiB", 9, ".1f"),
)


def _print_table(results: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]] | None) -> None:
    head = f"{'case':<22}" + "".join(f" {title:>{w}}" for _, title, w, _ in _COLUMNS) + f" {'tokens':>12}"
    print(head)
    for case, r in results.items():
        rows = [("", r)] if before is None or case not in before else [("before", before[case]), ("after", r)]
        for label, row in rows:
            name = f"{case} {label}".rstrip()
            line = f"{name:<22}" + "".join(f" {row[k]:>{w}{fmt}}" for k, _, w, fmt in _COLUMNS)
            print(line + f" {row['tokens']:>12}")
        if len(rows) == 2:
            b = before[case]  # type: ignore[index]
            ratio = "".join(
                f" {(b[k] / r[k] if r[k] else float('inf')):>{w - 1}.2f}x" for k, _, w, _ in _COLUMNS
            )
            same = "same" if b["tokens"] == r["tokens"] else "DIFFER"
            print(f"{case + ' before/after':<22}" + ratio + f" {same:>12}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", nargs="+", choices=["clover", "sdar", "llada2"], default=["clover", "sdar"])
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new-tokens", type=int, default=32, help="Per request.")
    parser.add_argument("--reps", type=int, default=3, help="Timed repetitions (after one warm-up).")
    parser.add_argument("--sampling", choices=["greedy", "seeded", "mixed"], default="mixed")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads.")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="cpu: this thread's CPU time (steadier on a shared CPU; with --threads 1 "
                        "torch computes in this thread); wall: wall clock (use it on a GPU).")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--json", type=Path, default=None, help="Write the figures here.")
    parser.add_argument("--against", type=Path, default=None, help="A saved --json run to compare with.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    results: dict[str, dict[str, Any]] = {}
    for arch in args.arch:
        with tempfile.TemporaryDirectory() as tmp:
            folder = write_demo_checkpoint(Path(tmp) / arch, seed=0, size=args.size, arch=arch)
            lm = load_checkpoint(folder, device=args.device, dtype=getattr(torch, args.dtype))
        c = lm.config
        print(f"{arch} {args.size}: vocab {c.vocab_size}, {c.num_hidden_layers} layers, "
              f"block {c.block_size}, "
              f"{args.device} {args.dtype}, torch threads {torch.get_num_threads()}, "
              f"{args.new_tokens} new tokens per request, {args.sampling}", flush=True)
        for batch in args.batch:
            results[f"{arch} b{batch}"] = measure(lm, batch, args.reps, args.new_tokens, args.sampling, clock)
    before = json.loads(args.against.read_text()) if args.against else None
    print(f"\nper engine pass ({args.clock} time, medians over every pass of the timed repetitions):")
    _print_table(results, before)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
