"""Self-distillation for parallel decoding: the starting checkpoint's own answers as targets.

A block-diffusion model commits several tokens in one pass only where it is sure of each of them
(``dynamic`` decoding at a threshold): a model trained on the corpus's answers stays unsure of
tokens it cannot read off the contract, and of the phrasing around them, and commits about one
token per pass. A stage trained on the answers it already writes one token per pass (a target it
can reproduce exactly, unlike the truth) learns to write them from a fully masked block, so that
more of each block clears the threshold on the first pass without new answers to learn: the
certainty-forcing distillation of dParallel (Chen et al., 2025), here without a separate teacher.
Measured on the trained demo (docs/demo-training.md, eleventh round): a little more per pass, and
some decisions and generation lost.

``own_answer_rows``: ``count`` training-split generation cases (``corpus.generation_case``, the
stage's seed), each decoded greedily by the starting checkpoint one token per pass (the most
confident masked position of the block first, as ``static`` decoding with one step per token),
as rows whose target is that answer and EOS. The decode runs ``worker.training.passes.denoise``
(the trainer's own pass, no engine threads) over fixed batches of cases, so the pool is a function
of the checkpoint and the seed: a resumed stage rebuilds the same pool.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from worker.model.tokenizer import Tokenizer
from worker.training.corpus import Split, generation_case
from worker.training.passes import denoise
from worker.training.rows import Row, answer_row, generation_prompt

MAX_ANSWER = 48  # new tokens at most, as the evaluation decodes a generation case


BATCH = 16  # cases decoded side by side (rows of one pass, each at its own block)


@torch.no_grad()
def greedy_answers(
    model: Any, prompts: list[list[int]], block: int, mask_id: int, eos: set[int]
) -> list[list[int] | None]:
    """Each prompt's answer decoded one token per pass, block by block (blocks at multiples of
    ``block``, as the engine and the trainer place them: a prompt's partial last block is the first
    one decoded), cut at its first EOS; None: no EOS within ``MAX_ANSWER`` tokens."""
    ids = [list(p) for p in prompts]
    answers: list[list[int] | None] = [None] * len(prompts)
    live = list(range(len(prompts)))
    while live:
        starts = {r: len(ids[r]) // block * block for r in live}  # the current block of each row
        for r in live:
            ids[r] += [mask_id] * (starts[r] + block - len(ids[r]))
        width = max(starts[r] + block for r in live)
        batch = torch.full((len(live), width), mask_id)  # [R, T]
        valid = torch.zeros(len(live), width, dtype=torch.bool)  # [R, T]
        for i, r in enumerate(live):
            batch[i, : len(ids[r])] = torch.tensor(ids[r])
            valid[i, : len(ids[r])] = True
        commit = torch.tensor([starts[r] for r in live])  # [R]
        while True:
            masked = (batch == mask_id) & valid  # [R, T]
            if not masked.any():
                break
            logits = denoise(model, batch, commit, valid).float()  # [R, T, V]
            logits[..., mask_id] = float("-inf")  # never commit a mask token (as the engine)
            confidence, token = logits.softmax(-1).max(-1)  # [R, T]
            confidence = confidence.masked_fill(~masked, -1.0)
            position = confidence.argmax(-1)  # [R]: each row's most confident masked position
            rows = masked.any(-1).nonzero().flatten()
            batch[rows, position[rows]] = token[rows, position[rows]]
        still = []
        for i, r in enumerate(live):
            new = batch[i, starts[r] : starts[r] + block].tolist()
            ids[r][starts[r] :] = new
            generated = ids[r][len(prompts[r]) :]
            # the engine's limit: an EOS among the first MAX_ANSWER new tokens, else "length"
            stop = next((k for k, t in enumerate(generated[:MAX_ANSWER]) if t in eos), None)
            if stop is not None:
                answers[r] = generated[:stop]
            elif len(generated) < MAX_ANSWER:
                still.append(r)
        live = still
    return answers


def own_answer_rows(
    model: Any,
    tokenizer: Tokenizer,
    seed: int,
    count: int,
    block: int,
    mask_id: int,
    headings: bool = False,
    split: Split = "train",
) -> list[Row]:
    """The pool of the stage: one row per generation case of the training ``split`` whose own
    answer ends (at most ``count``), in case order."""
    model.eval()
    eos = set(tokenizer.eos_token_ids)
    cases = [generation_case(split, seed, i, headings) for i in range(count)]
    prompts = [generation_prompt(case, tokenizer) for case in cases]
    rows: list[Row] = []
    for first in range(0, count, BATCH):
        chunk = prompts[first : first + BATCH]
        for prompt, answer in zip(chunk, greedy_answers(model, chunk, block, mask_id, eos), strict=True):
            if answer is not None:
                rows.append(replace(answer_row(prompt, answer, tokenizer, block), whole=True))
    if not rows:
        raise ValueError(f"none of the {count} answers of the pool ended within {MAX_ANSWER} tokens")
    return rows
