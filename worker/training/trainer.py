"""Train the demo checkpoint on CPU with the engine's block-diffusion objective (plain torch).

The loop of ``bench.quant_trained`` made a product command (``cloverq model train-demo``): a row
holds the clean tokens of blocks ``0..n-1`` (Clover: commit rows, SDAR: the block-causal prefix)
and block ``n`` with a random fraction of its *predicted* positions (``worker.training.rows``:
a decision's choice slots, a generation's answer) replaced by the mask token, as the engine
denoises it; cross-entropy on the masked positions. ``n`` is drawn among the blocks holding a
predicted position. AdamW, warm-up then cosine decay to 10 %.

Deterministic: every step's batch comes from ``(seed, step)`` alone (the corpus index and a torch
generator seeded per step), so a run resumed from its ``resume.pt`` takes the same steps as an
uninterrupted one; with one torch thread and ``torch.use_deterministic_algorithms`` the same
command gives the same bytes.
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

from worker.decisions.spec import DecisionMode
from worker.model.checkpoint import SINGLE_NAME, load_checkpoint
from worker.model.demo import DemoArch, write_demo_checkpoint
from worker.model.hf_names import hf_targets
from worker.model.manifest import write_manifest
from worker.model.tokenizer import Tokenizer
from worker.training.corpus import decision_case, generation_case
from worker.training.rows import Row, decision_rows, generation_row
from worker.training.tokenizer import train_tokenizer

RESUME_FILE = "resume.pt"
TRAINING_FILE = "training.json"  # how the weights were made: the config, steps, losses, wall time


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


def _batch(step: int, config: TrainConfig, tokenizer: Tokenizer, block: int) -> list[Row]:
    """The rows of ``step``: a function of (seed, step) only."""
    rng = random.Random(f"train-demo/{config.seed}/{step}")
    rows = []
    for i in range(config.batch):
        index = step * config.batch + i
        if rng.random() < config.decision_share:
            mode: DecisionMode = rng.choice(("joint", "independent"))
            rows.append(
                rng.choice(decision_rows(decision_case("train", config.seed, index), mode, tokenizer, block))
            )
        else:
            rows.append(generation_row(generation_case("train", config.seed, index), tokenizer, block))
    return rows


def denoise(
    model: Any, ids: torch.Tensor, commit_lens: torch.Tensor, valid: torch.Tensor | None = None
) -> Any:
    """Logits ``[R, T, V]`` of one denoising pass as the engine runs it (with gradients): row
    ``r``'s first ``commit_lens[r]`` tokens are committed, the rest (up to ``valid``) the current
    block. Clover: commit rows then preview rows against a fresh cache; SDAR: block-causal mask."""
    forward = type(model).forward.__wrapped__  # the forward without its no_grad
    r, t = ids.shape
    pos = torch.arange(t).expand(r, -1)
    blocks = pos // model.config.block_size
    if model.config.family != "clover":
        return forward(model, ids, pos, blocks, valid=valid)
    cache = model.new_cache(max_seqs=r, max_len=t, device="cpu", dtype=torch.float32)
    slots = torch.tensor([cache.allocate() for _ in range(r)])
    return forward(model, ids, pos, blocks, valid=valid, cache=cache, slots=slots, commit_lens=commit_lens)


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


def _noisy_batch(
    rows: list[Row], block: int, mask_id: int, gen: torch.Generator, served_slots: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noisy ids ``[B, T]``, clean ids ``[B, T]``, masked ``[B, T]``, commit lens ``[B]``,
    valid ``[B, T]``). ``served_slots``: rows with ``units`` (decisions) by ``served_decision``."""
    picked: list[tuple[Row, int, list[int] | None, list[int]]] = []
    for row in rows:
        if served_slots and row.units:
            blocks = slot_blocks(row, block)
            n = blocks[int(torch.randint(len(blocks), (1,), generator=gen))]
            targets, hidden = served_decision(row, block, n)
            picked.append((row, n, targets, hidden))
            continue
        candidates = sorted({i // block for i, p in enumerate(row.predicted) if p})
        picked.append((row, candidates[int(torch.randint(len(candidates), (1,), generator=gen))], None, []))
    width = max((n + 1) * block for _, n, _, _ in picked)
    clean = torch.full((len(rows), width), mask_id)
    masked = torch.zeros(len(rows), width, dtype=torch.bool)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    hide = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, (row, n, fixed_targets, hidden) in enumerate(picked):
        end = (n + 1) * block
        clean[r, :end] = torch.tensor(row.ids[:end])
        valid[r, :end] = True
        if fixed_targets is not None:
            masked[r, fixed_targets] = True
            hide[r, hidden] = True
            continue
        targets = torch.tensor(row.predicted[n * block : end])  # [block]
        ratio = torch.rand(1, generator=gen)
        chosen = targets & (torch.rand(block, generator=gen) < ratio)
        if not chosen.any():  # at least one masked target per row
            where = targets.nonzero().flatten()
            chosen[where[int(torch.randint(len(where), (1,), generator=gen))]] = True
        masked[r, n * block : end] = chosen
    noisy = clean.masked_fill(masked | hide, mask_id)
    commit = torch.tensor([n * block for _, n, _, _ in picked])
    return noisy, clean, masked, commit, valid


def optimizer_and_schedule(params: list[torch.nn.Parameter], *, lr: float,
                           steps: int) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
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
    return {k: v for k, v in asdict(config).items() if v is not None}


@dataclass
class TrainResult:
    steps: int
    seconds: float
    first_loss: float
    final_loss: float  # mean over the last 50 steps
    finished: bool


Progress = Callable[[int, float], None]  # (steps done, loss of that step)


def train_demo(
    folder: Path, config: TrainConfig, *, max_seconds: float | None = None, progress: Progress | None = None
) -> TrainResult:
    """Train (or resume training of) the demo in ``folder``; the checkpoint is written at the end.

    A fresh run writes the random demo (``seed``) with the corpus-trained tokenizer into
    ``folder``; every ``save_every`` steps (and when ``max_seconds`` runs out) ``resume.pt`` holds
    the model, optimizer and schedule; the finished run writes the trained weights, a new
    manifest and ``training.json``, and removes ``resume.pt``.
    """
    torch.use_deterministic_algorithms(True)
    resume = folder / RESUME_FILE
    if not resume.is_file():
        if folder.exists():
            shutil.rmtree(folder)
        if config.init_from is not None:  # a further stage: its weights and tokenizer, a fresh optimizer
            skip = shutil.ignore_patterns("README.md", TRAINING_FILE)
            shutil.copytree(config.init_from, folder, ignore=skip)
            write_manifest(folder)
        else:
            write_demo_checkpoint(folder, seed=config.seed, size="tiny", arch=config.arch,
                                  tokenizer=train_tokenizer(config.seed))  # fmt: skip
    lm = load_checkpoint(folder, dtype=torch.float32)
    model, block = lm.model, lm.config.block_size or 4
    mask_id = lm.config.mask_token_id
    assert mask_id is not None
    params = [p for p in model.parameters() if p.requires_grad]
    opt, schedule = optimizer_and_schedule(params, lr=config.lr, steps=config.steps)
    losses: list[float] = []
    step = 0
    if resume.is_file():
        state = torch.load(resume, weights_only=False)
        if state["config"] != asdict(config):
            raise ValueError(f"{resume} was made with another configuration: {state['config']}")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step, losses = state["step"], state["losses"]

    def save_resume() -> None:
        torch.save({"config": asdict(config), "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "schedule": schedule.state_dict(), "step": step, "losses": losses}, resume)  # fmt: skip

    began = time.monotonic()
    model.train()
    while step < config.steps:
        if max_seconds is not None and time.monotonic() - began > max_seconds:
            save_resume()
            break
        gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        rows = _batch(step, config, lm.tokenizer, block)
        served = bool(config.served_slots)
        noisy, clean, masked, commit, valid = _noisy_batch(rows, block, mask_id, gen, served)
        logits = denoise(model, noisy, commit, valid)  # [B, T, V]
        if config.decision_weight is None:
            loss = F.cross_entropy(logits[masked], clean[masked])
        else:  # a weighted mean over the targets: a decision row's count decision_weight times
            row_weight = torch.tensor([config.decision_weight if row.units else 1.0 for row in rows])
            weight = row_weight[:, None].expand_as(masked)[masked]
            ce = F.cross_entropy(logits[masked], clean[masked], reduction="none")
            loss = (ce * weight).sum() / weight.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        schedule.step()
        losses.append(loss.item())
        step += 1
        if progress is not None:
            progress(step, losses[-1])
        if step % config.save_every == 0 and step < config.steps:
            save_resume()
    model.eval()
    seconds = time.monotonic() - began
    tail = losses[-50:]
    result = TrainResult(step, seconds, losses[0], sum(tail) / len(tail), step >= config.steps)
    if result.finished:
        save_hf(model, folder)
        (folder / TRAINING_FILE).write_text(json.dumps(
            {"config": _recorded(config), "steps": step, "first_loss": round(losses[0], 4),
             "final_loss": round(result.final_loss, 4)}, indent=2, sort_keys=True) + "\n")  # fmt: skip
        resume.unlink(missing_ok=True)
        write_manifest(folder)
    return result
