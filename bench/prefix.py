"""Prefix-cache benchmark on a demo checkpoint (``python -m bench.prefix``).

Two workloads over one ~2,000-token contract, each run with the prefix cache off (the baseline,
``prefix_cache_bytes=0``) and on, in the same process and run:

  1. an independent decision with 16 questions (``worker.decisions``: one sequence per question,
     all queued at once with ``Engine.submit_many`` as the worker does): engine busy time (model
     forwards plus engine work) and process CPU time, off / on. Goal (issue 21): >= 5x less
     engine time. On a shared CPU wall times swing with other load; CPU time is steadier;
  2. 20 generate jobs over the same contract, one after another (each a new job with its own
     question, as separate API jobs arrive): the prefill share, i.e. prompt positions run through
     the model over all prompt positions of the 20 jobs, off / on (goal: >= 5x lower), and
     engine time.

Memory per sequence: every sequence owns a preallocated slot, and a shared prefix is *copied*
into it, so a sequence's committed state is the same with the cache on; what the cache adds is its
stored prefixes (one entry per divergence point, within the byte budget), shown per entry and
amortised over the sequences that used it. Outputs are compared between off and on.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from scheduler.infra.queue_names import QueueName
from worker.decisions import DecisionSpec, plan_decision
from worker.decisions.spec import DecisionQuestion
from worker.engine.engine import Engine, EngineConfig
from worker.engine.stats import EngineStats
from worker.engine.types import GenerationRequest, SamplingParams
from worker.model.checkpoint import LoadedModel, load_checkpoint
from worker.model.demo import write_demo_checkpoint

MIB = 1024 * 1024
_PARTIES = ("supplier", "buyer", "carrier", "insurer", "licensor", "agent")
_DUTIES = ("deliver the goods", "pay each invoice", "keep the records", "notify the other party",
           "insure the shipment", "return the samples", "protect confidential data", "audit the site")


def contract(tokenizer: object, target_tokens: int) -> str:
    """A synthetic contract of about ``target_tokens`` tokens (numbered clauses)."""
    clauses: list[str] = []
    i = 0
    while True:
        party, duty = _PARTIES[i % len(_PARTIES)], _DUTIES[(3 * i) % len(_DUTIES)]
        clauses.append(f"{i + 1}. The {party} shall {duty} within {7 + i % 23} days of each request.")
        text = "\n".join(clauses)
        if len(tokenizer.encode(text)) >= target_tokens:  # type: ignore[attr-defined]
            return text
        i += 1


def _engine(lm: LoadedModel, prefix_bytes: int, max_batch: int, max_len: int) -> Engine:
    engine = Engine(
        lm.model,
        EngineConfig(max_batch=max_batch, max_len=max_len, max_tokens_in_flight=max_batch * max_len,
                     prefix_cache_bytes=prefix_bytes),
        mask_token_id=lm.config.mask_token_id,
        eos_token_ids=(),  # random weights: decode the whole region every time
        default_block_size=lm.config.block_size,
    )
    engine.start()
    engine.warm_up()
    return engine


def _delta(after: EngineStats, before: EngineStats) -> dict[str, float]:
    return {
        "busy_s": after.busy_seconds - before.busy_seconds,
        "forward_s": after.forward_seconds - before.forward_seconds,
        "prefill": after.prefill_positions - before.prefill_positions,
        "reused": after.prefix_reused_positions - before.prefix_reused_positions,
        "hits": after.prefix_cache_hits - before.prefix_cache_hits,
        "misses": after.prefix_cache_misses - before.prefix_cache_misses,
        "stores": after.prefix_cache_stores - before.prefix_cache_stores,
        "store_bytes": after.prefix_cache_bytes,
        "entries": after.prefix_cache_entries,
    }


def decision(lm: LoadedModel, text: str, questions: int, prefix_bytes: int, max_len: int,
             rationale: int) -> tuple[dict[str, float], list[list[int]]]:
    """One independent decision of ``questions`` questions over ``text``."""
    spec = DecisionSpec(
        mode="independent",
        context=text,
        questions=tuple(
            DecisionQuestion(id=f"q{i}", text=f"Does clause {3 * i + 1} oblige the {_PARTIES[i % 6]}?",
                             choices=("yes", "no", "unclear"))
            for i in range(questions)
        ),
        rationale=rationale > 0,
    )
    plan = plan_decision(spec, lm.tokenizer, request_id="bench", params=SamplingParams(),
                         rationale_tokens=max(rationale, 1), slot_class=QueueName.STANDARD.value)
    engine = _engine(lm, prefix_bytes, questions, max_len)
    try:
        before = engine.stats()
        began, cpu = time.perf_counter(), time.process_time()
        results = [f.result() for f in engine.submit_many(plan.requests)]
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu
        out = _delta(engine.stats(), before)
    finally:
        engine.stop()
    if any(r.error for r in results):
        raise RuntimeError(f"decision failed: {next(r.error for r in results if r.error)}")
    out["wall_s"], out["cpu_s"] = wall, cpu
    out["sequences"] = len(results)
    out["prompt"] = sum(len(r.prompt_ids) for r in plan.requests) / len(plan.requests)
    block = lm.config.block_size
    out["whole"] = sum(len(r.prompt_ids) // block * block for r in plan.requests)
    return out, [r.token_ids for r in results]


def jobs(lm: LoadedModel, text: str, count: int, prefix_bytes: int, max_len: int,
         new_tokens: int) -> tuple[dict[str, float], list[list[int]]]:
    """``count`` generate jobs over ``text``, one after another, each with its own question."""
    prompts = []
    for i in range(count):
        ask = f"Question {i + 1}: what must the {_PARTIES[i % 6]} do under clause {i + 2}?"
        user = f"Contract:\n{text}\n\n{ask}"
        rendered = lm.tokenizer.render_chat([{"role": "user", "content": user}], enable_thinking=False)
        prompts.append(lm.tokenizer.encode(rendered))
    engine = _engine(lm, prefix_bytes, 4, max_len)
    tokens = []
    try:
        before = engine.stats()
        began, cpu = time.perf_counter(), time.process_time()
        for i, prompt in enumerate(prompts):
            request = GenerationRequest(f"job{i}", prompt, SamplingParams(max_new_tokens=new_tokens))
            tokens.append(engine.submit(request).result().token_ids)
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu
        out = _delta(engine.stats(), before)
    finally:
        engine.stop()
    out["wall_s"], out["cpu_s"] = wall, cpu
    out["sequences"] = count
    out["prompt"] = sum(len(p) for p in prompts) / count
    out["whole"] = sum(len(p) // lm.config.block_size * lm.config.block_size for p in prompts)
    return out, tokens


def _memory_line(lm: LoadedModel, r: dict[str, float], engine_max_len: int) -> str:
    """Committed state per sequence (its slot's K/V for its prompt, plus its GDN state) and the
    cache's stored bytes amortised over the sequences."""
    from worker.model.kv_cache import KVCache

    param = next(lm.model.parameters())
    cache_cls = type(lm.model.new_cache(max_seqs=1, max_len=1, device="cpu", dtype=param.dtype))
    per_pos = KVCache.bytes_per_position(lm.config, param.dtype)
    fixed = cache_cls.bytes_per_sequence(lm.config)
    used = r["prompt"] * per_pos + fixed
    slot = engine_max_len * per_pos + fixed
    stored = r["store_bytes"] / r["sequences"]
    return (f"{used / MIB:8.2f} MiB committed ({per_pos} B/position, {fixed / MIB:.2f} MiB GDN state), "
            f"slot {slot / MIB:.2f} MiB, + store {stored / MIB:.2f} MiB/seq")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, default=None, help="Default: a fresh demo checkpoint.")
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--arch", choices=["clover", "sdar", "llada2"], default="clover")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--context", type=int, default=2000, help="Tokens of the shared contract.")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--rationale", type=int, default=0,
                        help="Rationale tokens per answer (0: the choice only).")
    parser.add_argument("--new-tokens", type=int, default=16, help="Per generate job.")
    parser.add_argument("--budget-mib", type=int, default=512, help="prefix_cache_bytes of the 'on' runs.")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's).")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.checkpoint or write_demo_checkpoint(Path(tmp) / args.size, seed=0, size=args.size,
                                                          arch=args.arch)
        lm = load_checkpoint(folder, device=args.device, dtype=getattr(torch, args.dtype))
    c = lm.config
    total, active = c.param_counts()
    text = contract(lm.tokenizer, args.context)
    max_len = args.context + 256
    print(f"checkpoint: {args.checkpoint or args.size} "
          f"({total / 1e6:.1f} M params, {active / 1e6:.1f} M active), "
          f"family {c.family}, block {c.block_size}, device {args.device}, {args.dtype}, "
          f"torch threads {torch.get_num_threads()}; contract {len(lm.tokenizer.encode(text))} tokens, "
          f"cache budget {args.budget_mib} MiB")
    budget = args.budget_mib * MIB

    print(f"\n[1] independent decision, {args.questions} questions, rationale {args.rationale} tokens")
    print(f"{'cache':>6} {'engine s':>9} {'CPU s':>8} {'prefill pos':>12} {'reused pos':>11} "
          f"{'hits':>5} {'stores':>6}  memory per sequence")
    d_off, t_off = decision(lm, text, args.questions, 0, max_len, args.rationale)
    d_on, t_on = decision(lm, text, args.questions, budget, max_len, args.rationale)
    for name, r in (("off", d_off), ("on", d_on)):
        print(f"{name:>6} {r['busy_s']:>9.2f} {r['cpu_s']:>8.2f} {r['prefill']:>12.0f} {r['reused']:>11.0f} "
              f"{r['hits']:>5.0f} {r['stores']:>6.0f}  {_memory_line(lm, r, max_len)}")
    print(f"  engine time off/on: {d_off['busy_s'] / d_on['busy_s']:.1f}x (goal >= 5x); "
          f"CPU time off/on: {d_off['cpu_s'] / d_on['cpu_s']:.1f}x; "
          f"wall off/on: {d_off['wall_s'] / d_on['wall_s']:.1f}x; "
          f"prompt {d_on['prompt']:.0f} tokens/question; tokens equal: {t_off == t_on}")

    print(f"\n[2] {args.jobs} generate jobs over the contract, one after another, "
          f"{args.new_tokens} new tokens each")
    print(f"{'cache':>6} {'engine s':>9} {'CPU s':>8} {'prefill pos':>12} {'prefill share':>14} "
          f"{'hits':>5} {'stores':>6} {'entries':>8} {'store MiB':>10}")
    j_off, u_off = jobs(lm, text, args.jobs, 0, max_len, args.new_tokens)
    j_on, u_on = jobs(lm, text, args.jobs, budget, max_len, args.new_tokens)
    for name, r in (("off", j_off), ("on", j_on)):
        share = r["prefill"] / r["whole"]
        print(f"{name:>6} {r['busy_s']:>9.2f} {r['cpu_s']:>8.2f} {r['prefill']:>12.0f} "
              f"{100 * share:>13.1f}% "
              f"{r['hits']:>5.0f} {r['stores']:>6.0f} {r['entries']:>8.0f} {r['store_bytes'] / MIB:>10.2f}")
    share_ratio = (j_off["prefill"] / j_off["whole"]) / (j_on["prefill"] / j_on["whole"])
    print(f"  prefill share off/on: {share_ratio:.1f}x lower (goal >= 5x); "
          f"engine time off/on: {j_off['busy_s'] / j_on['busy_s']:.1f}x; "
          f"CPU time off/on: {j_off['cpu_s'] / j_on['cpu_s']:.1f}x; tokens equal: {u_off == u_on}")
    print(f"  memory per sequence: {_memory_line(lm, j_on, max_len)}")


if __name__ == "__main__":
    main()
