"""Train the demo checkpoint on CPU with the engine's block-diffusion objective (plain torch).

The loop of ``bench.quant_trained`` made a product command (``cloverq model train-demo``): a row
holds the clean tokens of blocks ``0..n-1`` (Clover: commit rows, SDAR: the block-causal prefix)
and block ``n`` with a random fraction of its *predicted* positions (``worker.training.rows``:
a decision's choice slots, a generation's answer) replaced by the mask token, as the engine
denoises it; cross-entropy on the masked positions. ``n`` is drawn among the blocks holding a
predicted position. AdamW, warm-up then cosine decay to 10 %.

Options left unset keep the first recipe's draws and loss (the shipped checkpoint's command):
``served_slots`` (decision rows noised as the engine decodes them), ``parallel_slots`` and
``groups`` (more answer targets per pass), ``easy_steps`` (first questions first), ``buckets``
(passes over rows of like length), ``hidden``/``layers``/``layer_pattern`` (a bigger or
attention-only random start), ``headings`` (headed clauses, questions naming them), ``vocab`` (a
larger corpus tokenizer), ``value_share`` (value questions: retrieval rows), ``block_size`` (a
larger block), ``extract_share`` (extraction rows), ``tool_share`` (tool-call rows, and a tokenizer
that has seen their chats), ``tool_keys`` (tool rows noised and weighted at the tokens that decide
the call), ``joint_share`` (more question rows asked jointly), ``self_distill`` (a stage trained
on the starting checkpoint's own answers), ``chain_blocks`` (a generation row's later answer
blocks trained from its first pass's cache, ``worker.training.chain``), ``certainty`` (a
certainty-forcing term on generation targets, ``worker.training.certainty``), ``cached_pool``
(a self-distillation stage's pool decoded against a cache); what each did is measured in
docs/demo-training.md.

Deterministic: every step's batch comes from ``(seed, step)`` alone (the corpus index and a torch
generator seeded per step), so a run resumed from its ``resume.pt`` takes the same steps as an
uninterrupted one; with one torch thread and ``torch.use_deterministic_algorithms`` the same
command gives the same bytes on one machine; pinning the process's float path
(``worker.training.float_path``: the CLI does it) is meant to extend that to any x86-64 machine
with AVX2 of the same vendor (not shown across CPU models), and its CPU-model pin to machines of
the same CPU model. ``training.json`` and the resume point record the path, and a
resume on another path is refused.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from worker.decisions.spec import DecisionMode
from worker.model.checkpoint import SINGLE_NAME, load_checkpoint
from worker.model.demo import DemoArch, write_json
from worker.model.hf_names import hf_targets
from worker.model.manifest import write_manifest
from worker.model.tokenizer import Tokenizer
from worker.training.certainty import certainty_term, certainty_weights
from worker.training.chain import Chain, chain_loss, draw_chain
from worker.training.corpus import (
    Split,
    decision_case,
    extraction_case,
    focus_case,
    focus_value_case,
    generation_case,
    tool_call_case,
    value_case,
)
from worker.training.float_path import is_pinned, path_record
from worker.training.passes import denoise, denoise_kept
from worker.training.questions import GROUPS
from worker.training.rows import Row, decision_rows, extraction_row, generation_row, tool_call_row
from worker.training.self_distill import own_answer_rows
from worker.training.shape import TINY_HIDDEN, TINY_LAYERS, reblock, write_shaped_demo
from worker.training.tokenizer import train_tokenizer

RESUME_FILE = "resume.pt"
TRAINING_FILE = "training.json"  # how the weights were made: the config, steps, losses, wall time
# ``ema``: the average starts as the first step's weights (AveragedModel copies them, no warm-up),
# which keep ``ema ** (steps - 1)`` of the checkpoint; a decay that leaves them more is refused
EMA_FIRST_SHARE = 0.01


@dataclass(frozen=True)
class TrainConfig:
    arch: DemoArch = "clover"
    steps: int = 1500
    batch: int = 16
    lr: float = 3e-3
    seed: int = 0
    decision_share: float = 0.6  # of the rows per step; the rest are generation rows
    save_every: int = 100  # steps between resume points
    init_from: str | None = None  # continue from this trained demo's weights and tokenizer (a new stage)
    # Decision rows noised as the engine serves them (``_noisy_batch``); None/False: the first
    # recipe (a random share of a block's slot positions, EOS padding predicted), kept so a
    # checkpoint made with it still matches its command.
    served_slots: bool | None = None
    decision_weight: float | None = None  # loss weight of a decision row's targets (None: 1)
    # share of the decision rows with several choice slots trained with all of them masked in one
    # pass (``parallel_decision``); None: every decision row served block by block
    parallel_slots: float | None = None
    # question groups per training contract (None: one or two, as the evaluation asks): a joint
    # row with more questions gives a parallel pass more answer targets per prompt
    groups: int | None = None
    # the first steps' decision rows: only a group's first question asked alone (independent), a
    # curriculum: the model learns to route an answer to its question's clause on those before the
    # joint layout (find the question by its id) and the second questions (compare a number)
    easy_steps: int | None = None
    buckets: int | None = None  # passes per step over rows of similar length (``bucketed_loss``)
    hidden: int | None = None  # a wider random start than the tiny demo's 64 (``worker.training.shape``)
    layers: int | None = None  # a deeper one than its 4
    # Clover layer types of the random start, a pattern of L (GDN) / A (attention) repeated over
    # the layers (``shape.layer_types``; None: "LA", the demo's alternation); "A": attention only
    layer_pattern: str | None = None
    # the corpus with section headings that questions repeat (``corpus.decision_case``), the
    # tokenizer learned on it; a checkpoint trained so is evaluated on headed cases too
    headings: bool | None = None
    # the corpus tokenizer's size (None: 512); the BPE stops where the corpus has no more merges
    # (2048 asked gives 882 ids: whole words, every country and day count one token, rows ~25% shorter)
    vocab: int | None = None
    # share of the decision rows that ask a value question about the contract instead
    # (``corpus.value_case``: "Which law governs?"), the retrieval the comparisons are built on
    value_share: float | None = None
    # the random start's block size (None: the demo's 4), or with init_from the stage's (None: the
    # starting checkpoint's): a larger block lets a confident model commit more tokens per pass (the
    # preview operator scales with ln(B/32), CLOVER.md); no weight depends on it
    block_size: int | None = None
    # share of the decision rows (after value questions) that are extraction rows instead
    # (``corpus.extraction_case``: an extract job's prompt and its schema's canvas)
    extract_share: float | None = None
    # share of the generation rows that are tool-call rows instead (``corpus.tool_call_case``: a
    # chat with the tools on offer, the call to make or a one-line answer); the corpus tokenizer
    # then learns those chats too
    tool_share: float | None = None
    # tool-call rows noised at their deciding tokens (``Row.keys``: the first answer token, the
    # function's name, the argument's value): in half the rows the block is drawn among those
    # holding one; in every row they are targets wherever the block holds them, weighted this much
    # (None: a tool row is noised as any generation row, whose random block holds the name in
    # about one row of five)
    tool_keys: float | None = None
    # share of the (question) decision rows asked jointly (None: half, drawn as the first recipe
    # drew it); joint mode's extra hop (a slot finds its question by its id) gets more practice
    joint_share: float | None = None
    # a stage (``init_from``) whose generation rows are the starting checkpoint's own answers to
    # this many training cases (``worker.training.self_distill``): aims at more tokens per pass
    # under ``dynamic`` decoding
    self_distill: int | None = None
    # the training split ``train_wide`` (``corpus``): each clause in six wordings instead of three
    # (the held-out one still unseen), for the rows and a fresh run's tokenizer
    wide_phrasings: bool | None = None
    # oversample one question kind (``corpus.focus_case``): this share of the decision rows asks
    # ``focus_kind`` about a contract of its own (besides the kind's rows in the mix), half of them
    # its value question, half one of its group's questions asked alone; meant for a kind the mix
    # leaves at its prior (law: a comparison of two tokens, docs/demo-training.md)
    focus_kind: str | None = None
    focus_share: float | None = None
    # the first steps: every row a ``focus_kind`` row, a curriculum (in the probes, law asked alone
    # was learned in a few hundred steps of law rows only, never in the mix; docs/demo-training.md)
    focus_steps: int | None = None
    # share of the ``focus_kind`` rows that ask its group's two questions jointly (one slot each,
    # found by its id) instead of one alone: the joint layout gets the focus kind too (a law-only
    # start taught law asked alone, never read jointly; docs/demo-training.md, thirteenth round).
    # Fifteenth round: half the focus rows joint (f4) did not teach the joint layout law either
    focus_joint: float | None = None
    # the checkpoint written is an exponential moving average of the weights, this decay per step
    # (``torch.optim.swa_utils``' EMA): the schedule ends at 10% of ``lr`` with batches of 16, so
    # the last step's weights carry that step's noise; training itself is unchanged (the same
    # steps, the same optimizer state), only the weights written differ
    ema: float | None = None
    # a row without choice slots (generation, tool call) is trained over up to this many
    # consecutive answer blocks per step: its first pass as before, then one pass per further block
    # that commits the block before it and previews it against the cache (``worker.training.chain``,
    # the engine's fused pass): more answer targets per prompt forward. Clover only; needs buckets
    chain_blocks: int | None = None
    # the certainty-forcing term's weight (``worker.training.certainty``): at the targets of rows
    # without choice slots, this much of the entropy of a prediction that is already right is
    # added to its cross-entropy, so ``dynamic`` decoding finds more positions sure. Per target of
    # the step's weighted mean: its denominator stays the cross-entropy weights (a decision target
    # counts ``decision_weight``), so the term's share of the loss follows the mix. Needs buckets
    certainty: float | None = None
    # ``self_distill``'s pool decoded with the committed tokens in a cache
    # (``self_distill.cached_greedy_answers``: the same passes, a block's width of tokens each
    # instead of the whole prefix; Clover only); None: every pass over the whole prefix, as the
    # stages before the option were made
    cached_pool: bool | None = None


def training_split(config: TrainConfig) -> Split:
    """The corpus split the rows (and a fresh run's tokenizer) are drawn from."""
    return "train_wide" if config.wide_phrasings else "train"


def _batch(
    step: int, config: TrainConfig, tokenizer: Tokenizer, block: int, own: list[Row] | None = None
) -> list[Row]:
    """The rows of ``step``: a function of (seed, step) only (and of ``own``, the stage's pool of
    the starting checkpoint's answers, which replaces the generation rows when given)."""
    rng = random.Random(f"train-demo/{config.seed}/{step}")
    split = training_split(config)
    rows = []
    for i in range(config.batch):
        index = step * config.batch + i
        if config.focus_steps is not None and step < config.focus_steps:  # draws only when set
            rows.append(_focus_row(split, config, index, rng, tokenizer, block))
            continue
        if rng.random() < config.decision_share:
            if config.focus_share and rng.random() < config.focus_share:  # draws only when set
                rows.append(_focus_row(split, config, index, rng, tokenizer, block))
                continue
            if config.value_share and rng.random() < config.value_share:  # draws only when set and > 0
                value = value_case(split, config.seed, index, rng.random(), bool(config.headings))
                rows.append(decision_rows(value, "independent", tokenizer, block)[0])
                continue
            if config.extract_share and rng.random() < config.extract_share:  # the same: only when set
                extraction = extraction_case(split, config.seed, index, bool(config.headings))
                rows.append(extraction_row(extraction, tokenizer, block))
                continue
            case = decision_case(split, config.seed, index, config.groups, bool(config.headings))
            if config.easy_steps is not None and step < config.easy_steps:
                # first a group's first question, asked alone (one hop: question -> clause)
                rows.append(rng.choice(decision_rows(case, "independent", tokenizer, block)[0::2]))
                continue
            if config.joint_share is None:
                mode: DecisionMode = rng.choice(("joint", "independent"))
            else:  # another draw than the default's: only when set
                mode = "joint" if rng.random() < config.joint_share else "independent"
            rows.append(rng.choice(decision_rows(case, mode, tokenizer, block)))
        elif config.tool_share and rng.random() < config.tool_share:  # draws only when set and > 0
            rows.append(tool_call_row(tool_call_case(split, config.seed, index, bool(config.headings)),
                                      tokenizer, block))
        elif own:
            rows.append(own[index % len(own)])
        else:
            generation = generation_case(split, config.seed, index, bool(config.headings))
            rows.append(generation_row(generation, tokenizer, block))
    return rows


def _focus_row(
    split: Split, config: TrainConfig, index: int, rng: random.Random, tokenizer: Tokenizer, block: int
) -> Row:
    """A ``focus_kind`` row (``TrainConfig.focus_share``/``focus_steps``): with ``focus_joint``,
    that share its group asked jointly; else its value question, or one of its group's questions
    asked alone (even odds, drawn from the step's ``rng``)."""
    kind, headings = str(config.focus_kind), bool(config.headings)
    if config.focus_joint and rng.random() < config.focus_joint:  # draws only when set
        return rng.choice(decision_rows(focus_case(split, config.seed, index, kind, headings), "joint",
                                        tokenizer, block))  # fmt: skip
    if rng.random() < 0.5:
        return decision_rows(focus_value_case(split, config.seed, index, kind, headings), "independent",
                             tokenizer, block)[0]  # fmt: skip
    return rng.choice(decision_rows(focus_case(split, config.seed, index, kind, headings), "independent",
                                    tokenizer, block))  # fmt: skip


def bucketed_loss(
    model: Any,
    noisy: torch.Tensor,
    clean: torch.Tensor,
    masked: torch.Tensor,
    commit: torch.Tensor,
    valid: torch.Tensor,
    weight: torch.Tensor,
    buckets: int,
    chain: Chain | None = None,
    certainty: torch.Tensor | None = None,
) -> torch.Tensor:
    """The step's weighted mean cross-entropy over its targets, the same quantity as one pass over
    the padded batch, computed in ``buckets`` passes over rows of similar length (sorted by their
    valid length, each pass cut to its longest row) with logits only at the targets. A step mixes
    prompts of 200 to 500 tokens and a [B, T] pass pays for the longest; the LM head over every
    position costs about as much as a layer. Not bit-identical to the one-pass loss (another sum
    order), hence an option: a checkpoint made without it still matches its command. ``weight``
    ``[B, T]``: each target's loss weight. With a ``chain`` (``worker.training.chain``), each
    bucket's chained passes add their targets to the mean (``weight`` ``[B, >= chain.width]``):
    the mean of the first passes' and the links' targets, as if each had a long pass of its own.
    ``certainty`` (``[B, >= T]``, ``worker.training.certainty``): each target's weight of the
    certainty term, added to its cross-entropy (the mean's denominator stays the cross-entropy
    weights')."""
    lengths = valid.sum(dim=1)
    order = sorted(range(len(lengths)), key=lambda r: (int(lengths[r]), r))
    size = -(-len(order) // buckets)
    total = torch.zeros(())
    weight_sum = torch.zeros(())
    for start in range(0, len(order), size):
        rows = torch.tensor(order[start : start + size])
        width = int(lengths[rows].max())
        targets = [masked[r].nonzero().flatten() for r in rows.tolist()]
        k = max(len(t) for t in targets)
        index = torch.stack([torch.cat([t, t[:1].expand(k - len(t))]) for t in targets])  # [b, K]
        real = torch.stack([torch.arange(k) < len(t) for t in targets])  # [b, K]
        if chain is not None and any(chain.blocks[r] for r in rows.tolist()):  # a bucket with links
            logits, cache, slots = denoise_kept(model, noisy[rows, :width], commit[rows], valid[rows, :width],
                                                index, max_len=chain.width)  # fmt: skip
            links, links_weight = chain_loss(model, cache, slots, rows.tolist(), chain, weight,
                                               model.config.block_size, certainty)  # fmt: skip
            total, weight_sum = total + links, weight_sum + links_weight
        else:
            logits = denoise(model, noisy[rows, :width], commit[rows], valid[rows, :width], index)  # [b,K,V]
        gold = clean[rows].gather(1, index)
        ce = F.cross_entropy(logits.flatten(0, 1), gold.flatten(), reduction="none").view_as(gold)
        counted = weight[rows].gather(1, index) * real
        total = total + (ce * counted).sum()
        weight_sum = weight_sum + counted.sum()
        if certainty is not None:
            total = total + (certainty_term(logits, gold) * certainty[rows].gather(1, index) * real).sum()
    return total / weight_sum


def slot_blocks(row: Row, block: int) -> list[int]:
    """The blocks of ``row`` holding part of a choice slot (a decision row's candidate blocks)."""
    return sorted({p // block for start, length in row.units for p in range(start, start + length)})


def served_decision(row: Row, block: int, n: int) -> tuple[list[int], list[int]]:
    """(the masked targets, the earlier positions given as mask tokens) of decision ``row`` when
    block ``n`` is denoised as the engine decodes it: every slot position in ``n`` is masked (a
    slot is scored and committed whole); a slot that reaches ``n`` from an earlier block has its
    positions there masked too (``worker.sampler.sequence``: they stay mask tokens in the
    committed prefix until the slot's last block decides it), but they are not targets."""
    targets, hidden = [], []
    for start, length in row.units:
        if (start + length - 1) // block < n or start // block > n:
            continue
        for p in range(start, start + length):
            if p // block == n:
                targets.append(p)
            elif p // block < n:
                hidden.append(p)
    return targets, hidden


def parallel_decision(row: Row, block: int) -> tuple[int, int, list[int]]:
    """(first and end block, the targets) of decision ``row`` with every choice slot masked at
    once: the committed prefix ends at the block of the first slot, the pass runs to the end of the
    last slot's block. Not a pass the engine makes (it decides a joint row's slots block by
    block), but a pass that asks every question of the row against the contract alone: an answer
    target per question for one forward over the (long, shared) prompt."""
    first = row.units[0][0] // block
    last = (row.units[-1][0] + row.units[-1][1] - 1) // block
    targets = [p for start, length in row.units for p in range(start, start + length)]
    return first, last, targets


def _noisy_batch(
    rows: list[Row],
    block: int,
    mask_id: int,
    gen: torch.Generator,
    served_slots: bool = False,
    parallel_slots: float | None = None,
    keyed: bool = False,
    chain: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noisy ids ``[B, T]``, clean ids ``[B, T]``, masked ``[B, T]``, commit lens ``[B]``,
    valid ``[B, T]``). ``served_slots``: rows with ``units`` (decisions) by ``served_decision``;
    ``parallel_slots``: that share of the rows with several slots by ``parallel_decision``;
    ``keyed``: rows with ``keys`` (tool calls) at a block holding a key in half the rows, every key
    in the block a target; ``chain`` (blocks a chain covers, ``worker.training.chain``): rows
    without ``units`` at a block drawn among those from which a chain still reaches the answer's
    last block (the first one when the answer has at most ``chain`` blocks): every block a target."""
    # (row, first block of the pass, its last block, fixed targets or None, hidden positions)
    picked: list[tuple[Row, int, int, list[int] | None, list[int]]] = []
    for row in rows:
        parallel = parallel_slots is not None and len(row.units) > 1  # draws only when set
        if parallel and float(torch.rand(1, generator=gen)) < (parallel_slots or 0.0):
            first, last, targets = parallel_decision(row, block)
            picked.append((row, first, last, targets, []))
            continue
        if served_slots and row.units:
            blocks = slot_blocks(row, block)
            n = blocks[int(torch.randint(len(blocks), (1,), generator=gen))]
            targets, hidden = served_decision(row, block, n)
            picked.append((row, n, n, targets, hidden))
            continue
        if chain is not None and not row.units:
            candidates = sorted({i // block for i, p in enumerate(row.predicted) if p})
            starts = candidates[: max(1, len(candidates) - chain + 1)]
            n = starts[int(torch.randint(len(starts), (1,), generator=gen))] if len(starts) > 1 else starts[0]
            picked.append((row, n, n, None, []))
            continue
        # a tool row's pass at a block of its keys in half the rows, else at any block (as a
        # generation row): the markup around them is learned too (keys only broke the format)
        if keyed and row.keys and float(torch.rand(1, generator=gen)) < 0.5:
            candidates = sorted({p // block for p in row.keys})
        else:
            candidates = sorted({i // block for i, p in enumerate(row.predicted) if p})
        n = candidates[int(torch.randint(len(candidates), (1,), generator=gen))]
        picked.append((row, n, n, None, []))
    width = max((last + 1) * block for _, _, last, _, _ in picked)
    clean = torch.full((len(rows), width), mask_id)
    masked = torch.zeros(len(rows), width, dtype=torch.bool)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    hide = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, (row, n, last, fixed_targets, hidden) in enumerate(picked):
        end = (last + 1) * block
        clean[r, :end] = torch.tensor(row.ids[:end])
        valid[r, :end] = True
        if fixed_targets is not None:
            masked[r, fixed_targets] = True
            hide[r, hidden] = True
            continue
        targets = torch.tensor(row.predicted[n * block : end])  # [block]
        if row.whole:  # the block's first pass: every target masked (no draw)
            masked[r, n * block : end] = targets
            continue
        ratio = torch.rand(1, generator=gen)
        chosen = targets & (torch.rand(block, generator=gen) < ratio)
        if keyed and row.keys:  # the deciding tokens of this block are always targets
            chosen[[p - n * block for p in row.keys if p // block == n]] = True
        if not chosen.any():  # at least one masked target per row
            where = targets.nonzero().flatten()
            chosen[where[int(torch.randint(len(where), (1,), generator=gen))]] = True
        masked[r, n * block : end] = chosen
    noisy = clean.masked_fill(masked | hide, mask_id)
    commit = torch.tensor([n * block for _, n, _, _, _ in picked])
    return noisy, clean, masked, commit, valid


def target_weights(rows: list[Row], config: TrainConfig, width: int) -> torch.Tensor:
    """``[B, width]`` loss weights: a decision row's targets ``decision_weight`` (1 unset), a tool
    row's deciding tokens ``tool_keys`` (``Row.keys``), every other target 1."""
    decision = 1.0 if config.decision_weight is None else config.decision_weight
    row_weight = torch.tensor([decision if row.units else 1.0 for row in rows])
    weight = row_weight[:, None].expand(len(rows), width).clone()
    if config.tool_keys is not None:
        for r, row in enumerate(rows):
            weight[r, [p for p in row.keys if p < width]] = config.tool_keys
    return weight


def declare_joint_decode(folder: Path, decode: str | None) -> None:
    """Record in ``generation_config.json`` how the checkpoint's joint decisions decode best
    (``joint_decode``, read by the worker when ``CLOVERQ_DECIDE_JOINT_DECODE`` is ``auto``; None:
    no declaration, block by block): a model that saw every joint row in the parallel pass
    (``--parallel-slots 1.0``) never trained the block-by-block one. A stage trained on another
    (``init_from``) replaces the earlier stage's declaration."""
    path = folder / "generation_config.json"
    gen = json.loads(path.read_text())
    if gen.get("joint_decode") == decode:
        return  # nothing to change (the file keeps its bytes)
    gen.pop("joint_decode", None)
    if decode is not None:
        gen["joint_decode"] = decode
    write_json(path, gen)


def optimizer_and_schedule(
    params: list[torch.nn.Parameter], *, lr: float, steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (weight decay 0.01) with a linear warm-up over the first 5% of ``steps``, then a
    cosine from ``lr`` down to 10% of it: the demo training's schedule (also bench.quant_trained's)."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps)))
    )
    return opt, schedule


def save_hf(model: Any, folder: Path) -> None:
    """Write ``model``'s weights into checkpoint ``folder`` in the published layout (per-expert
    tensors: the inverse of ``hf_names.hf_targets``) and refresh its manifest."""
    params = dict(model.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    for name, target in hf_targets(model.config).items():
        p = params[target.param].detach()
        half = p.shape[-1] // 2
        if target.part == "gate":
            t = p[target.expert, :, :half].T  # ours [E, H, 2I] -> theirs [I, H]
        elif target.part == "up":
            t = p[target.expert, :, half:].T
        elif target.part == "down":
            t = p[target.expert].T  # ours [E, I, H] -> theirs [H, I]
        else:
            t = p.reshape(target.shape)  # e.g. conv taps [C, K] -> [C, 1, K]
        tensors[name] = t.contiguous().clone()
    mode = (folder / "config.json").stat().st_mode & 0o777
    save_file(tensors, str(folder / SINGLE_NAME), metadata={"format": "pt"})
    (folder / SINGLE_NAME).chmod(mode)
    write_manifest(folder)


def _recorded(config: TrainConfig) -> dict[str, object]:
    """The configuration as ``training.json`` records it: options left unset are left out (so a
    checkpoint made before an option existed still matches what its command writes now)."""
    return _recorded_of(asdict(config))


def _recorded_of(fields: dict[str, object]) -> dict[str, object]:
    """``fields`` without the options left unset (None): a resume point written before an option
    existed holds no entry for it, or None; either way it was unset."""
    return {k: v for k, v in fields.items() if v is not None}


@dataclass
class TrainResult:
    steps: int
    seconds: float
    first_loss: float
    final_loss: float  # mean over the last 50 steps
    finished: bool


Progress = Callable[[int, float], None]  # (steps done, loss of that step)


class TrainConfigError(ValueError):
    """A configuration (or a resume point's) that ``train_demo`` refuses before it trains: a user's
    mistake, said in one line (``cloverq model train-demo`` prints it as a usage error)."""


def check_config(config: TrainConfig) -> None:
    """Raise :class:`TrainConfigError` for options that cannot go together."""
    shaped = {"vocab": config.vocab, "hidden": config.hidden, "layers": config.layers,
              "layer_pattern": config.layer_pattern}  # fmt: skip
    given = ", ".join(name for name, value in shaped.items() if value is not None)
    if config.init_from is not None and given:
        raise TrainConfigError(f"init_from continues a trained demo's shape and tokenizer; drop {given}")
    if config.block_size is not None and config.block_size < 1:
        raise TrainConfigError(f"block_size is a number of positions, at least 1: {config.block_size}")
    keys = config.tool_keys
    if keys is not None and (config.buckets is None or not config.tool_share or keys <= 0):
        raise TrainConfigError("tool_keys (> 0) weighs the tokens of tool rows: it needs tool_share and "
                               "buckets (the per-target loss)")
    if config.self_distill is not None and (config.init_from is None or config.self_distill < 1):
        raise TrainConfigError("self_distill (>= 1 cases) trains on a trained demo's own answers: it needs "
                               "init_from")
    if config.joint_share is not None and not 0.0 <= config.joint_share <= 1.0:
        raise TrainConfigError(f"joint_share is a share: {config.joint_share}")
    if (config.focus_kind is None) != (config.focus_share is None and config.focus_steps is None):
        raise TrainConfigError("focus_kind goes with focus_share (its share of decision rows) or focus_steps "
                               "(the first steps all its rows), and they with it")  # fmt: skip
    if config.focus_kind is not None and config.focus_kind not in GROUPS:
        kinds = ", ".join(sorted(GROUPS))
        raise TrainConfigError(f"focus_kind is a question kind ({kinds}): {config.focus_kind}")
    if config.focus_steps is not None and config.focus_steps < 1:
        raise TrainConfigError(f"focus_steps is a number of first steps, at least 1: {config.focus_steps}")
    if config.focus_share is not None and config.decision_share == 0.0:
        raise TrainConfigError("focus_share is a share of the decision rows: decision_share is 0")
    if config.focus_share is not None and not 0.0 < config.focus_share <= 1.0:
        raise TrainConfigError(f"focus_share is a share above 0: {config.focus_share}")
    if config.focus_joint is not None and (config.focus_kind is None or not 0.0 < config.focus_joint <= 1.0):
        raise TrainConfigError(f"focus_joint is a share above 0 of the focus_kind rows: {config.focus_joint}")
    if config.chain_blocks is not None and (config.chain_blocks < 2 or config.buckets is None):
        raise TrainConfigError(f"chain_blocks (>= 2 blocks a row) chains passes inside the per-target loss: "
                               f"it needs buckets: {config.chain_blocks}")  # fmt: skip
    if config.chain_blocks is not None and config.tool_keys is not None:  # a chain draws no key blocks
        raise TrainConfigError("chain_blocks trains every block of a tool row; tool_keys draws a row's block "
                               "at its keys: one or the other")  # fmt: skip
    if config.certainty is not None and (not config.certainty > 0 or config.buckets is None):  # nan too
        raise TrainConfigError(f"certainty (> 0) weighs a term of the per-target loss: it needs buckets: "
                               f"{config.certainty}")  # fmt: skip
    if config.cached_pool and config.self_distill is None:
        raise TrainConfigError("cached_pool decodes a self_distill stage's pool: it needs self_distill")
    if config.ema is not None and not 0.0 < config.ema < 1.0:
        raise TrainConfigError(f"ema is a decay per step, between 0 and 1: {config.ema}")
    share = 0.0 if config.ema is None else config.ema ** (config.steps - 1)
    if share > EMA_FIRST_SHARE:
        raise TrainConfigError(f"ema {config.ema} over {config.steps} steps leaves {share:.1%} of the "
                               f"checkpoint to the first step's weights (at most {EMA_FIRST_SHARE:.0%}): "
                               "a smaller decay or more steps")  # fmt: skip


def train_demo(
    folder: Path, config: TrainConfig, *, max_seconds: float | None = None, progress: Progress | None = None
) -> TrainResult:
    """Train (or resume training of) the demo in ``folder``; the checkpoint is written at the end.

    A fresh run writes the random demo (``seed``) with the corpus-trained tokenizer into
    ``folder``; every ``save_every`` steps (and when ``max_seconds`` runs out) ``resume.pt`` holds
    the model, optimizer and schedule (and, with ``ema``, the moving average); the finished run
    writes the trained weights (the average, with ``ema``), a new manifest and ``training.json``,
    and removes ``resume.pt``.
    """
    check_config(config)
    torch.use_deterministic_algorithms(True)
    # deterministic mode also fills each new tensor with NaN (to expose reads of uninitialised
    # memory): about 2,300 fills a step, 4% of it; nothing here reads one (same bytes either way)
    torch.utils.deterministic.fill_uninitialized_memory = False
    resume = folder / RESUME_FILE
    if not resume.is_file():
        if folder.exists():
            shutil.rmtree(folder)
        if config.init_from is not None:  # a further stage: its weights and tokenizer, a fresh optimizer
            skip = shutil.ignore_patterns("README.md", TRAINING_FILE)
            shutil.copytree(config.init_from, folder, ignore=skip)
            if config.block_size is not None:  # the same weights, decoded and trained in other blocks
                reblock(folder, config.block_size)
            write_manifest(folder)
        else:  # the tiny demo's random start, or a wider / deeper one (the tiny demo when unset)
            write_shaped_demo(folder, seed=config.seed, arch=config.arch,
                              tokenizer=train_tokenizer(config.seed, total_vocab=config.vocab or 512,
                                                        headings=bool(config.headings),
                                                        tools=bool(config.tool_share),
                                                        split=training_split(config)),
                              hidden=config.hidden or TINY_HIDDEN, layers=config.layers or TINY_LAYERS,
                              pattern=config.layer_pattern or "LA",
                              block_size=config.block_size)  # fmt: skip
    lm = load_checkpoint(folder, dtype=torch.float32)
    model, block = lm.model, lm.config.block_size or 4
    if config.chain_blocks is not None and lm.config.family != "clover":
        raise TrainConfigError(f"chain_blocks continues a Clover pass's cache; {folder} is "
                               f"{lm.config.family}")  # fmt: skip
    if config.cached_pool and lm.config.family != "clover":
        raise TrainConfigError(f"cached_pool decodes against a Clover cache; {folder} is {lm.config.family}")
    mask_id = lm.config.mask_token_id
    assert mask_id is not None
    own = None
    pooled = time.monotonic()
    if config.self_distill is not None:  # the starting weights' answers (a resumed stage: the same pool)
        own = own_answer_rows(model, lm.tokenizer, config.seed, config.self_distill, block, mask_id,
                              bool(config.headings), training_split(config),
                              cached=bool(config.cached_pool))  # fmt: skip
    pool_seconds = time.monotonic() - pooled  # counted in the run's seconds, not in max_seconds
    params = [p for p in model.parameters() if p.requires_grad]
    opt, schedule = optimizer_and_schedule(params, lr=config.lr, steps=config.steps)
    average = None  # the weights written when ``ema`` is set (a copy of the model's, averaged each step)
    if config.ema is not None:
        average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(config.ema))
    losses: list[float] = []
    step = 0
    # the kernels and the thread count: the threads split each reduction, so 1 and 2 give other bytes
    computed_on = path_record(torch.get_num_threads())
    pinned = is_pinned(computed_on)
    if resume.is_file():
        state = torch.load(resume, weights_only=False)
        if _recorded_of(state["config"]) != _recorded(config):  # options added since compare as unset
            raise TrainConfigError(f"{resume} was made with another configuration: {state['config']}")
        recorded = state.get("float_path")  # None: a point from before the record, on its machine's path
        if recorded is not None:  # a point from before threads were recorded: read as the CLI's default,
            recorded = {"threads": 1, **recorded}  # one (a run that set --threads then is not told apart)
        if recorded != computed_on and (recorded is not None or pinned):
            raise TrainConfigError(f"{resume} was computed on the float path {recorded or 'of its machine'}, "
                                   f"this process computes on {computed_on}: resumed, it would not give "
                                   "an uninterrupted run's bytes; resume it on the same path and --threads "
                                   "(train-demo pins its portable float path unless --native-float-path or "
                                   "--cpu-model-float-path)")  # fmt: skip
        model.load_state_dict(state["model"])
        if average is not None:
            average.load_state_dict(state["ema"])
        opt.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step, losses = state["step"], state["losses"]

    def save_resume() -> None:
        torch.save({"config": asdict(config), "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "schedule": schedule.state_dict(), "step": step, "losses": losses,
                    "float_path": computed_on,
                    "ema": None if average is None else average.state_dict()}, resume)  # fmt: skip

    began = time.monotonic()
    model.train()
    while step < config.steps:
        if max_seconds is not None and time.monotonic() - began > max_seconds:
            save_resume()
            break
        gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        rows = _batch(step, config, lm.tokenizer, block, own)
        served = bool(config.served_slots)
        noisy, clean, masked, commit, valid = _noisy_batch(
            rows, block, mask_id, gen, served, config.parallel_slots, config.tool_keys is not None,
            chain=config.chain_blocks,
        )
        if config.buckets is not None:
            chain = None  # draws only when set, after the first passes': a run without it keeps its draws
            if config.chain_blocks is not None:
                chain = draw_chain(rows, commit, block, mask_id, config.chain_blocks, gen)
            width = max(masked.shape[1], chain.width if chain else 0)
            weight = target_weights(rows, config, width)
            certainty = None if config.certainty is None else certainty_weights(rows, config.certainty, width)
            loss = bucketed_loss(model, noisy, clean, masked, commit, valid, weight, config.buckets, chain,
                                 certainty)  # fmt: skip
        elif config.decision_weight is None:
            logits = denoise(model, noisy, commit, valid)  # [B, T, V]
            loss = F.cross_entropy(logits[masked], clean[masked])
        else:  # a weighted mean over the targets: a decision row's count decision_weight times
            logits = denoise(model, noisy, commit, valid)  # [B, T, V]
            weight = target_weights(rows, config, masked.shape[1])[masked]
            ce = F.cross_entropy(logits[masked], clean[masked], reduction="none")
            loss = (ce * weight).sum() / weight.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        schedule.step()
        if average is not None:
            average.update_parameters(model)
        losses.append(loss.item())
        step += 1
        if progress is not None:
            progress(step, losses[-1])
        if step % config.save_every == 0 and step < config.steps:
            save_resume()
    model.eval()
    seconds = time.monotonic() - began + pool_seconds
    tail = losses[-50:] or [math.nan]  # no step yet: a budget spent before the first one
    result = TrainResult(step, seconds, losses[0] if losses else math.nan, sum(tail) / len(tail),
                         step >= config.steps)  # fmt: skip
    if result.finished:
        save_hf(model if average is None else average.module, folder)
        one_pass = config.parallel_slots is not None and config.parallel_slots >= 1.0
        declare_joint_decode(folder, "one_pass" if one_pass else None)  # a later stage's own recipe decides
        record = {"config": _recorded(config), "steps": step, "float_path": computed_on,
                  "first_loss": round(losses[0], 4), "final_loss": round(result.final_loss, 4)}  # fmt: skip
        write_json(folder / TRAINING_FILE, record)
        resume.unlink(missing_ok=True)
        write_manifest(folder)
    return result
