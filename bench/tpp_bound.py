"""``python -m bench.tpp_bound``: what bounds the tokens per pass of ``dynamic`` decoding on the demo.

Issue 25 asks for 2.5 tokens per pass with ``dynamic`` at threshold 0.9; the trained demo's own
decode gives about 1.16. Two things can hold it there: the model is unsure of a block even when
everything before it is right (then a better prefix does not help: the model must become sure), or
its earlier blocks' mistakes are carried forward (a wrong prefix makes the next block harder, and
fixing the decode's errors would help). This bench separates them on the generation suite
(``worker.training.corpus.generation_cases``, prompts as ``bench.demo_quality.generation_report``
makes them):

- **gold prefix**: every answer block is decoded by the model with the engine's ``dynamic`` rule
  (``worker.sampler.commit.choose_commits``, greedy tokens and confidences as
  ``worker.sampler.selection.select_tokens`` gives them, the mask token never a prediction, quotas
  of ``worker.sampler.schedule.step_quotas``), but every earlier block holds the TRUE answer,
  laid out as the trainer lays out a generation row (``worker.training.rows.generation_row``:
  prompt, answer, EOS, EOS to a whole block; blocks at multiples of the block size, so the
  prompt's partial last block is the first one decoded). One pass is
  ``worker.training.passes.denoise`` (the trainer's pass, the engine's math without its cache),
  so no error of an earlier block compounds: the rate it reaches is what the model's confidence
  alone allows;
- **own decode**: the same cases through the engine (``SamplingParams(strategy="dynamic",
  threshold=t, steps_per_block=B, max_new_tokens=48)``, B the block size), the model's own blocks
  as the prefix: ``sum(r.tokens) / sum(r.steps_used)``, as ``GenerationTally`` counts it;
- **ceiling**: the gold answer's tokens over its minimum passes, one per block it touches (the
  prompt's shared block and the last partial one count as one pass each): no decoder with this
  block size can do better on these answers;
- **sure where right**: the gold-prefix decode again, but every masked position whose argmax is
  the true token counts as sure (committed in that pass whatever its confidence): the most that
  training the model to be sure of what it already gets right (``train-demo --certainty``) could
  give, with the positions it gets wrong still costing their passes (the gold decode runs twice
  per threshold).

Tokens per pass is counted two ways. *Answer tokens* are the engine's count (the output before its
first EOS, ``GenerationResult.tokens``) over the engine's passes, which end a block once its output
holds a committed EOS with nothing masked before it (``worker/engine/reference_decode.py`` rule 5,
``worker.sampler.sequence``'s ``_output_settled``): gold / own compares like with like.
*Positions* (the thirteenth round's count, docs/demo-training.md "What bounds tokens per pass")
are every position of the answer's blocks, EOS and its padding included, each block decoded to its
last mask: it is higher than the engine's count (the padding is cheap to be sure of) and is kept
to compare with that measurement. The first pass of every block (every position after the prompt
masked) gives how many positions the model is sure of (confidence strictly above the threshold,
as the engine commits) and how many of those are the true token, and how often its argmax is.

Run it niced with one torch thread on the shared machine: a few seconds on the demo.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from bench.demo_quality import GENERATION_MAX_NEW, started_engine
from worker.engine.types import GenerationRequest, SamplingParams
from worker.model.checkpoint import load_checkpoint
from worker.model.tokenizer import Tokenizer
from worker.sampler.commit import choose_commits
from worker.sampler.schedule import step_quotas
from worker.sampler.selection import RowSampling, select_tokens
from worker.training.corpus import GenerationCase, generation_cases
from worker.training.passes import denoise
from worker.training.rows import generation_prompt, generation_row

MAX_NEW = GENERATION_MAX_NEW  # new tokens, as bench.demo_quality's generation report decodes a case
BATCH = 16  # block rows denoised side by side (each row one case's block over its gold prefix)
THRESHOLDS = (0.5, 0.7, 0.9, 0.99)
GROUPS = ("all", "plain", "thinking")


@dataclass(frozen=True)
class GoldRow:
    """One case laid out as the trainer's generation row, cut to what the engine would decode."""

    ids: tuple[int, ...]  # prompt, answer, EOS, EOS padding; up to the end of the last answer block
    start: int  # first answer position (the prompt's length)
    answer: int  # answer tokens before the EOS within MAX_NEW (the engine's ``tokens``)
    thinking: bool

    def blocks(self, block: int) -> range:
        """The blocks holding an output position: the prompt's partial block first."""
        return range(self.start // block, len(self.ids) // block)


def gold_row(case: GenerationCase, tokenizer: Tokenizer, block: int) -> GoldRow:
    """``generation_row`` of ``case``, ending with the block of its EOS (or of its ``MAX_NEW``-th
    token, where the engine stops for length)."""
    row = generation_row(case, tokenizer, block)
    start = len(generation_prompt(case, tokenizer))
    answer = len(tokenizer.encode(case.target))
    out_end = start + min(answer + 1, MAX_NEW)  # through the EOS, or the length limit
    end = -(-out_end // block) * block
    return GoldRow(tuple(row.ids[:end]), start, min(answer, MAX_NEW), case.thinking)


@dataclass
class Tally:
    """One group's counts at one threshold (sums over its cases)."""

    cases: int = 0
    answer_tokens: int = 0  # the engine's count: before the EOS
    positions: int = 0  # every masked position of the answer's blocks (EOS padding included)
    blocks: int = 0  # minimum passes
    passes: int = 0  # blocks decoded to their last mask
    engine_passes: int = 0  # blocks ended as the engine ends them (a settled EOS)
    first_pass_sure: int = 0
    first_pass_sure_right: int = 0
    first_pass_argmax_right: int = 0

    def add(self, other: Tally) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def summary(self) -> dict[str, float | int | None]:
        return {
            **asdict(self),
            "tokens_per_pass": _ratio(self.answer_tokens, self.engine_passes),
            "ceiling": _ratio(self.answer_tokens, self.blocks),
            "positions_per_pass": _ratio(self.positions, self.passes),
            "positions_ceiling": _ratio(self.positions, self.blocks),
            "first_pass_argmax_accuracy": _ratio(self.first_pass_argmax_right, self.positions),
        }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


@dataclass
class _BlockRun:
    """One case's block over its gold prefix, as the engine's row state for that block."""

    case: int
    lo: int  # the block's first position
    first: int  # its first masked position (after the prompt)
    out_end: int  # the end of the engine's output positions in it (MAX_NEW)
    quotas: list[int] = field(default_factory=list)
    passes: int = 0
    engine_passes: int = 0  # the pass its output settled at; 0: never (the block ran to its end)


@torch.no_grad()
def gold_prefix_bound(
    model: Any,
    rows: list[GoldRow],
    block: int,
    mask_id: int,
    eos: set[int],
    threshold: float,
    sure_where_right: bool = False,
) -> list[Tally]:
    """Per row: every block of its answer decoded by ``dynamic`` at ``threshold``, every earlier
    block the gold answer (each block independent of the model's output in the others);
    ``sure_where_right``: a right argmax commits as if sure."""
    runs = [
        _BlockRun(i, b * block, max(b * block, row.start), min((b + 1) * block, row.start + MAX_NEW))
        for i, row in enumerate(rows)
        for b in row.blocks(block)
    ]
    tallies = [Tally(cases=1, answer_tokens=row.answer) for row in rows]
    for first in range(0, len(runs), BATCH):
        _decode_blocks(model, rows, runs[first : first + BATCH], block, mask_id, eos, threshold, tallies,
                       sure_where_right)  # fmt: skip
    return tallies


def _decode_blocks(
    model: Any,
    rows: list[GoldRow],
    runs: list[_BlockRun],
    block: int,
    mask_id: int,
    eos: set[int],
    threshold: float,
    tallies: list[Tally],
    sure_where_right: bool = False,
) -> None:
    """Decode ``runs`` side by side, pass by pass, as the engine decodes a block, into ``tallies``."""
    n = len(runs)
    width = max(r.lo + block for r in runs)
    ids = torch.full((n, width), mask_id)  # [R, T]
    valid = torch.zeros(n, width, dtype=torch.bool)  # [R, T]
    gold = torch.full((n, block), mask_id)  # [R, B] the true tokens of each block
    masked = torch.zeros(n, block, dtype=torch.bool)  # [R, B] still masked
    for k, r in enumerate(runs):
        row = rows[r.case]
        hi = r.lo + block
        ids[k, :hi] = torch.tensor(row.ids[:hi])
        gold[k] = ids[k, r.lo : hi]
        # the block as the engine starts it: every output position masked, none past the length
        # limit (the engine's last block ends at prompt + MAX_NEW, worker/sampler/sequence.py)
        stop = r.out_end
        ids[k, r.first : stop] = mask_id
        valid[k, :stop] = True
        masked[k, r.first - r.lo : stop - r.lo] = True
        r.quotas = step_quotas(stop - r.first, block)  # one step per position: quota 1
        tally = tallies[r.case]
        tally.positions += stop - r.first
        tally.blocks += 1
    index = torch.tensor([list(range(r.lo, r.lo + block)) for r in runs])  # [R, B] the block's positions
    commit_lens = torch.tensor([r.lo for r in runs])  # [R] the committed (gold) prefix
    live = torch.arange(n)
    while len(live):
        w = max(runs[k].lo + block for k in live.tolist())
        logits = denoise(model, ids[live, :w], commit_lens[live], valid[live, :w], index[live]).float()
        logits[..., mask_id] = float("-inf")  # [L, B, V] never commit a mask token (runner.py, as the engine)
        m = len(live)
        greedy = RowSampling(temperature=torch.zeros(m), top_k=torch.zeros(m, dtype=torch.long),
                             top_p=torch.ones(m), filtering=False, sampling=False)  # fmt: skip
        tokens, confidence = select_tokens(logits, greedy, None)  # [L, B] x2
        still = masked[live]  # [L, B]
        quota = torch.tensor(
            [min(runs[k].quotas[runs[k].passes], int(masked[k].sum())) for k in live.tolist()]
        )
        # the engine's rule (worker/sampler/commit.py, choose_commits, as worker/engine/runner.py
        # calls it): every mask strictly above the threshold when there are at least `quota` of
        # them, else the `quota` most confident (quota 1 here: as many steps as positions)
        # sure_where_right: a right argmax as sure as can be, so the rule commits it (and the
        # quota's fallback to the most confident picks a right position first)
        rule = confidence  # [L, B]
        if sure_where_right:
            rule = torch.where(still & (tokens == gold[live]), 2.0, confidence)
        commit = choose_commits(rule, still, quota, torch.full((m,), threshold),
                                torch.ones(m, dtype=torch.bool))  # fmt: skip
        for j, k in enumerate(live.tolist()):
            r = runs[k]
            tally = tallies[r.case]
            if r.passes == 0:  # the block's first pass: every output position masked
                sure = still[j] & (confidence[j] > threshold)  # [B]
                tally.first_pass_sure += int(sure.sum())
                tally.first_pass_sure_right += int((sure & (tokens[j] == gold[k])).sum())
                tally.first_pass_argmax_right += int((still[j] & (tokens[j] == gold[k])).sum())
            r.passes += 1
            chosen = commit[j].nonzero().flatten() + r.lo  # [C] absolute positions
            ids[k, chosen] = tokens[j, chosen - r.lo]
            masked[k, chosen - r.lo] = False
            out = slice(r.first, r.out_end)
            if not r.engine_passes and _settled(ids[k, out].tolist(), rows[r.case].ids[out], mask_id, eos):
                r.engine_passes = r.passes  # the engine ends the block here
        done = ~masked[live].any(-1)  # [L]
        for k in live[done].tolist():
            r = runs[k]
            tallies[r.case].passes += r.passes
            tallies[r.case].engine_passes += r.engine_passes or r.passes
        live = live[~done]


def _settled(output: list[int], truth: Sequence[int], mask_id: int, eos: set[int]) -> bool:
    """The engine's early end of a block (``worker.sampler.sequence``'s ``_output_settled``): a
    committed EOS with no mask before it among the block's output positions, here only where the
    true answer ends. A wrong EOS would end the engine's request short of the answer; counting its
    block as ended there would credit the answer's tokens to fewer passes, so such a block is
    decoded to its last mask instead (the bound stays a bound)."""
    for t, true in zip(output, truth, strict=True):
        if t == mask_id:
            return False
        if t in eos:
            return true in eos
    return False


def grouped(tallies: list[Tally], rows: list[GoldRow]) -> dict[str, Tally]:
    out = {g: Tally() for g in GROUPS}
    for tally, row in zip(tallies, rows, strict=True):
        out["all"].add(tally)
        out["thinking" if row.thinking else "plain"].add(tally)
    return out


def own_decode(
    engine: Any, tokenizer: Tokenizer, cases: list[GenerationCase], threshold: float, block: int
) -> dict[str, Any]:
    """The model's own decode through the engine, as ``generation_report``'s ``dynamic`` config
    (``block`` steps per block of ``block`` positions: the fallback commits one token a pass)."""
    params = SamplingParams(max_new_tokens=MAX_NEW, strategy="dynamic", threshold=threshold,
                            steps_per_block=block)  # fmt: skip
    requests = [
        GenerationRequest(f"g{i}", generation_prompt(c, tokenizer), params) for i, c in enumerate(cases)
    ]
    counts = {g: [0, 0] for g in GROUPS}  # group -> [tokens, passes]
    for case, future in zip(cases, engine.submit_many(requests), strict=True):
        r = future.result()
        for g in ("all", "thinking" if case.thinking else "plain"):
            counts[g][0] += r.tokens
            counts[g][1] += r.steps_used
    return {g: {"tokens": t, "passes": p, "tokens_per_pass": _ratio(t, p)} for g, (t, p) in counts.items()}


def measure(
    checkpoint: Path, seed: int, count: int, thresholds: list[float], own: bool = True
) -> dict[str, Any]:
    """The report: per threshold, the gold-prefix tallies per group and (``own``) the own decode."""
    lm = load_checkpoint(checkpoint, dtype=torch.float32)
    lm.model.eval()
    block, mask_id = lm.config.block_size or 4, lm.config.mask_token_id
    assert mask_id is not None
    eos = set(lm.tokenizer.eos_token_ids)
    cases = generation_cases("eval", seed, count)
    rows = [gold_row(c, lm.tokenizer, block) for c in cases]
    report: dict[str, Any] = {
        "checkpoint": str(checkpoint), "seed": seed, "count": count, "block_size": block,
        "steps_per_block": block, "max_new_tokens": MAX_NEW, "thresholds": {},
    }  # fmt: skip
    for t in thresholds:
        groups = grouped(gold_prefix_bound(lm.model, rows, block, mask_id, eos, t), rows)
        right = grouped(gold_prefix_bound(lm.model, rows, block, mask_id, eos, t, True), rows)
        report["thresholds"][str(t)] = {
            "gold": {g: tally.summary() for g, tally in groups.items()},
            "sure_where_right": {g: tally.summary() for g, tally in right.items()},
        }
    if own:
        engine = started_engine(lm)
        try:
            for t in thresholds:
                report["thresholds"][str(t)]["own"] = own_decode(engine, lm.tokenizer, cases, t, block)
        finally:
            engine.stop()
    return report


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(report: dict[str, Any]) -> str:
    """Two markdown tables: the engine's count (gold, sure where right, ceiling, own) and the
    first pass with the thirteenth round's count of positions."""
    lines = [
        "| threshold | gold tok/pass all | plain | thinking | sure where right | ceiling | own tok/pass"
        " | gold/own | gold/ceiling | tokens gold / own |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t, entry in report["thresholds"].items():
        g = entry["gold"]
        own = entry.get("own", {}).get("all", {}).get("tokens_per_pass")
        gold = g["all"]["tokens_per_pass"]
        plain, thinking = g["plain"]["tokens_per_pass"], g["thinking"]["tokens_per_pass"]
        lines.append(
            f"| {t} | {_f(gold)} | {_f(plain)} | {_f(thinking)}"
            f" | {_f(entry['sure_where_right']['all']['tokens_per_pass'])}"
            f" | {_f(g['all']['ceiling'])} | {_f(own)} | {_f(gold / own if gold and own else None)}"
            f" | {_f(gold / g['all']['ceiling'] if gold else None)}"
            f" | {g['all']['answer_tokens']} / {entry.get('own', {}).get('all', {}).get('tokens', '-')} |"
        )
    lines += [
        "",
        "| threshold | first pass sure | sure right | argmax right | positions/pass all | plain | thinking"
        " | positions ceiling |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t, entry in report["thresholds"].items():
        g = entry["gold"]
        a = g["all"]
        lines.append(
            f"| {t} | {a['first_pass_sure']} of {a['positions']} | {a['first_pass_sure_right']}"
            f" | {a['first_pass_argmax_right']} ({_f(100 * a['first_pass_argmax_accuracy'], 1)}%)"
            f" | {_f(a['positions_per_pass'])} | {_f(g['plain']['positions_per_pass'])}"
            f" | {_f(g['thinking']['positions_per_pass'])} | {_f(a['positions_ceiling'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("worker/model/demo_trained/clover"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--count", type=int, default=30)
    parser.add_argument("--thresholds", default=",".join(map(str, THRESHOLDS)), help="comma-separated")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the full report here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    began = time.monotonic()
    report = measure(args.checkpoint, args.seed, args.count, [float(t) for t in args.thresholds.split(",")])
    report["seconds"] = round(time.monotonic() - began, 1)
    print(table(report))
    print(f"({args.count} cases, eval seed {args.seed}, {report['seconds']} s)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
