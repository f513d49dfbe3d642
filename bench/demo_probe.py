"""``python -m bench.demo_probe``: a short training probe of the demo's decisions, by question kind.

A full ``cloverq model train-demo`` run takes up to 30 minutes and mixes every question type,
generation and the joint layout; this trains only decision rows asked alone (independent layout),
of chosen question kinds and positions (a group's first question, its second, or both), from the
random start, with the trainer's own pieces (``_noisy_batch`` with ``served_slots``,
``bucketed_loss``, ``optimizer_and_schedule``), and scores them teacher-forced every
``--eval-every`` steps on the ``eval`` split (seed 1): the pass at the block of the first token
where the question's choices differ, served as the engine serves it (the slot masked whole), right
when the true choice's token scores highest there. It answers "can this shape and tokenizer learn
this kind of question, and how fast" for one kind in a few CPU minutes
(docs/demo-training.md, fourth round).

The recipe options are ``train-demo``'s (``--vocab``, ``--layer-pattern``, ``--hidden``,
``--layers``, ``--headings``), so a probe's finding maps onto a full run, with one difference:
``--value-share`` *adds* a contract's value question (``corpus.value_case``) to the pool, with its
own draws, where ``train-demo`` *replaces* that share of its decision rows. ``--clauses`` (shorter
contracts), ``--qk-gain`` (a sharper attention at the start), the ``--warm-*`` options (the first
steps on other kinds or shorter contracts) and ``--focus-kind`` (each contract drawn brings a
further case's rows of that kind, if it has them) are probe-only. Value questions
are scored too (``value:KIND``) at the first token where *any* two choices differ: where several
choices share that token ("EUR 250,000" / "EUR 500,000" at "EUR"), a tie credits the first of them,
so those kinds' figures are biased: with the 882-id tokenizer, liability (five amounts share
"EUR") and law (two of the six countries share a first token); the other five kinds are exact.
"""

from __future__ import annotations

import argparse
import collections
import random
import shutil
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from worker.decisions.spec import DecisionQuestion
from worker.decisions.templates import choice_sequences
from worker.model.checkpoint import load_checkpoint
from worker.model.tokenizer import Tokenizer
from worker.training import contracts
from worker.training.corpus import Split, decision_case, value_case
from worker.training.questions import GROUPS
from worker.training.rows import Row, decision_rows
from worker.training.shape import TINY_HIDDEN, TINY_LAYERS, write_shaped_demo
from worker.training.tokenizer import train_tokenizer
from worker.training.trainer import (
    _noisy_batch,
    bucketed_loss,
    denoise,
    optimizer_and_schedule,
    served_decision,
)

Item = tuple[Row, str, DecisionQuestion, str]  # (row, kind, question, true answer)
POSITIONS = {"first": (0,), "second": (1,), "both": (0, 1)}


def asked_alone(
    split: Split, seed: int, index: int, tokenizer: Tokenizer, block: int,
    kinds: Collection[str], positions: Collection[int], headings: bool,
) -> list[Item]:  # fmt: skip
    """The independent rows of case ``index`` whose question is of ``kinds`` and at ``positions``
    (0: a group's first question, 1: its second)."""
    case = decision_case(split, seed, index, headings=headings)
    rows = decision_rows(case, "independent", tokenizer, block)
    questions = case.spec("independent").questions
    return [
        (row, case.groups[i // 2].kind, questions[i], case.answers[i])
        for i, row in enumerate(rows)
        if case.groups[i // 2].kind in kinds and i % 2 in positions
    ]


def value_rows(
    split: Split,
    seed: int,
    index: int,
    tokenizer: Tokenizer,
    block: int,
    kinds: Collection[str],
    headings: bool,
) -> list[Item]:
    """Case ``index``'s value question (``corpus.value_case``) asked alone, if of ``kinds``."""
    draw = random.Random(f"value/{split}/{seed}/{index}").random()
    case = value_case(split, seed, index, draw, headings)
    kind = case.groups[0].kind
    if kind not in kinds:
        return []
    row = decision_rows(case, "independent", tokenizer, block)[0]
    return [(row, f"value:{kind}", case.spec("independent").questions[0], case.answers[0])]


def teacher_forced(
    model: Any, tokenizer: Tokenizer, items: list[Item], block: int, mask_id: int
) -> dict[str, list[int]]:
    """Per kind: [right, asked], each answer scored at the first token where its choices differ."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_ids[0]
    tally: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    with torch.no_grad():
        for row, kind, question, answer in items:
            sequences = choice_sequences(question, tokenizer, pad)
            d = next(k for k in range(len(sequences[0])) if len({s[k] for s in sequences}) > 1)
            start = row.units[0][0]
            n = (start + d) // block
            targets, hidden = served_decision(row, block, n)
            ids = torch.tensor(row.ids[: (n + 1) * block])[None]  # [1, T]
            ids[0, targets + hidden] = mask_id
            logits = denoise(model, ids, torch.tensor([n * block]))[0, start + d]  # [V]
            scores = [float(logits[s[d]]) for s in sequences]
            tally[kind][0] += int(question.choices[scores.index(max(scores))] == answer)
            tally[kind][1] += 1
    return dict(tally)


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--name", default="probe")
    parser.add_argument("--kinds", default=",".join(sorted(GROUPS)), help="question kinds, comma-separated")
    parser.add_argument("--questions", choices=sorted(POSITIONS), default="first")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=512, help="the corpus tokenizer's size")
    parser.add_argument("--layer-pattern", default="LA")
    parser.add_argument("--hidden", type=int, default=TINY_HIDDEN)
    parser.add_argument("--layers", type=int, default=TINY_LAYERS)
    parser.add_argument("--headings", action="store_true")
    parser.add_argument("--value-share", type=float, default=0.0,
                        help="share of training contracts also asked their value question")  # fmt: skip
    parser.add_argument(
        "--clauses", type=int, default=None, help="clauses per contract (default the corpus's)"
    )
    parser.add_argument(
        "--warm-steps", type=int, default=0,
        help="a curriculum: the first steps on --warm-kinds in --warm-clauses clauses (evaluated as after)",
    )
    parser.add_argument("--warm-kinds", default=None, help="the warm-up's kinds (default --kinds)")
    parser.add_argument("--focus-kind", default=None, choices=sorted(GROUPS),
                        help="oversample a kind: each contract drawn brings another's rows")  # fmt: skip
    parser.add_argument("--warm-value-share", type=float, default=None, help="the warm-up's --value-share")
    parser.add_argument("--warm-clauses", type=int, default=None, help="the warm-up's clauses per contract")
    parser.add_argument("--qk-gain", type=float, default=None, help="attention q/k norm scale at the start")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-contracts", type=int, default=150, help="eval split contracts (seed 1)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("/tmp/demo_probe"))
    return parser.parse_args()


def main() -> None:
    args = _args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    full_clauses = args.clauses or contracts.CLAUSES_PER_CONTRACT
    if args.clauses is not None:  # shorter contracts: the asked clause among fewer others
        contracts.CLAUSES_PER_CONTRACT = args.clauses
    kinds, positions = set(args.kinds.split(",")), POSITIONS[args.questions]
    folder = args.out / args.name
    if folder.exists():
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    began = time.process_time()
    write_shaped_demo(folder, seed=args.seed, arch="clover",
                      tokenizer=train_tokenizer(args.seed, total_vocab=args.vocab, headings=args.headings),
                      hidden=args.hidden, layers=args.layers, pattern=args.layer_pattern)  # fmt: skip
    lm = load_checkpoint(folder, dtype=torch.float32)
    model, tokenizer, block = lm.model, lm.tokenizer, lm.config.block_size or 4
    mask_id = lm.config.mask_token_id
    assert mask_id is not None
    evaluation = [
        item
        for i in range(args.eval_contracts)
        for item in asked_alone("eval", 1, i, tokenizer, block, kinds, positions, args.headings)
    ]
    if args.value_share:
        for i in range(args.eval_contracts):
            evaluation += value_rows("eval", 1, i, tokenizer, block, kinds, args.headings)
    lengths = [len(item[0].ids) for item in evaluation]
    print(f"{args.name}: vocab {lm.config.vocab_size}, eval questions {len(evaluation)}, "
          f"row tokens mean {sum(lengths) / len(lengths):.0f}, setup {time.process_time() - began:.0f} CPU s",
          flush=True)  # fmt: skip
    if args.qk_gain is not None:  # zero-centred norms: the scale is 1 + weight
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.fill_(args.qk_gain - 1.0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, schedule = optimizer_and_schedule(params, lr=args.lr, steps=args.steps)
    index, pool, train_cpu = 0, list[Item](), 0.0
    rng = random.Random(f"probe/{args.seed}")
    for step in range(1, args.steps + 1):
        t0 = time.process_time()
        warm = step <= args.warm_steps
        contracts.CLAUSES_PER_CONTRACT = args.warm_clauses or full_clauses if warm else full_clauses
        now = set(args.warm_kinds.split(",")) if warm and args.warm_kinds else kinds
        if not warm and step == args.warm_steps + 1:
            pool = []
        while len(pool) < args.batch:
            pool += asked_alone("train", args.seed, index, tokenizer, block, now, positions, args.headings)
            share = args.warm_value_share if warm and args.warm_value_share is not None else args.value_share
            if rng.random() < share:
                pool += value_rows("train", args.seed, index, tokenizer, block, now, args.headings)
            if args.focus_kind:
                focus = {args.focus_kind}
                other = index + 10**6  # further cases of the same stream (not train-demo's focus cases)
                pool += asked_alone("train", args.seed, other, tokenizer, block, focus, positions,
                                    args.headings)  # fmt: skip
                pool += value_rows("train", args.seed, other, tokenizer, block, focus, args.headings)
            index += 1
        rng.shuffle(pool)
        rows, pool = [item[0] for item in pool[: args.batch]], pool[args.batch :]
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        noisy, clean, masked, commit, valid = _noisy_batch(rows, block, mask_id, gen, served_slots=True)
        model.train()
        loss = bucketed_loss(model, noisy, clean, masked, commit, valid, torch.ones(masked.shape), 2)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        schedule.step()
        train_cpu += time.process_time() - t0
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            tally = teacher_forced(model, tokenizer, evaluation, block, mask_id)
            asked = [(r, n) for k, (r, n) in tally.items() if not k.startswith("value:")]
            share = 100 * sum(r for r, _ in asked) / max(1, sum(n for _, n in asked))
            per_kind = " ".join(f"{k} {r}/{n}" for k, (r, n) in sorted(tally.items()))
            print(f"{args.name} step {step}: loss {loss.item():.3f}, tf {share:.1f}% ({per_kind}), "
                  f"{train_cpu / step:.3f} CPU s/step", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
