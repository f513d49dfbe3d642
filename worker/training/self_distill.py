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
of the checkpoint and the seed: a resumed stage rebuilds the same pool. ``cached_pool`` stages
decode the same passes against a cache instead (``cached_greedy_answers``: the model's forward
with the engine's fused commit and preview, a block's tokens a pass rather than the prompt's).
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


def _surest(logits: torch.Tensor, masked: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's most confident masked position ``[R]`` and the token there ``[R]``, from logits
    ``[R, P, V]`` over ``P`` positions of which ``masked`` ``[R, P]`` may be committed (a mask token
    is never committed, as the engine)."""
    logits = logits.float()
    logits[..., mask_id] = float("-inf")
    confidence, token = logits.softmax(-1).max(-1)  # [R, P]
    position = confidence.masked_fill(~masked, -1.0).argmax(-1)  # [R]
    return position, token.gather(1, position[:, None]).squeeze(1)


def _end_blocks(
    ids: list[list[int]],
    prompts: list[list[int]],
    live: list[int],
    eos: set[int],
    answers: list[list[int] | None],
) -> list[int]:
    """After a block of every ``live`` row is resolved (in ``ids``): the rows whose answer goes on.
    The engine's limit: an EOS among the first ``MAX_ANSWER`` new tokens ends an answer (in
    ``answers``), else "length" (the row ends with no answer)."""
    still = []
    for r in live:
        generated = ids[r][len(prompts[r]) :]
        stop = next((k for k, t in enumerate(generated[:MAX_ANSWER]) if t in eos), None)
        if stop is not None:
            answers[r] = generated[:stop]
        elif len(generated) < MAX_ANSWER:
            still.append(r)
    return still


def _next_blocks(
    ids: list[list[int]], live: list[int], block: int, mask_id: int, offsets: list[int]
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Each ``live`` row's next block padded onto ``ids`` with mask tokens (blocks at multiples of
    ``block``: a prompt's partial last block is the first one decoded; at least one mask each),
    and the pass over them: the block starts ``[R]``, the batch ``[R, W]`` of each row's tokens from
    its ``offsets`` entry (0: the whole prefix) to its block's end, padded, and its valid mask."""
    starts = [len(ids[r]) // block * block for r in live]
    for r, start in zip(live, starts, strict=True):
        ids[r] += [mask_id] * (start + block - len(ids[r]))
    width = max(start + block - offset for start, offset in zip(starts, offsets, strict=True))
    batch = torch.full((len(live), width), mask_id)  # [R, W]
    valid = torch.zeros(len(live), width, dtype=torch.bool)  # [R, W]
    for i, (r, offset) in enumerate(zip(live, offsets, strict=True)):
        batch[i, : len(ids[r]) - offset] = torch.tensor(ids[r][offset:])
        valid[i, : len(ids[r]) - offset] = True
    return starts, batch, valid


@torch.no_grad()
def greedy_answers(
    model: Any, prompts: list[list[int]], block: int, mask_id: int, eos: set[int]
) -> list[list[int] | None]:
    """Each prompt's answer decoded one token per pass, block by block (blocks at multiples of
    ``block``, as the engine and the trainer place them: a prompt's partial last block is the first
    one decoded), cut at its first EOS; None: no EOS within ``MAX_ANSWER`` tokens. Every pass is the
    trainer's own (``passes.denoise``), over the whole prefix."""
    ids = [list(p) for p in prompts]
    answers: list[list[int] | None] = [None] * len(prompts)
    live = list(range(len(prompts)))
    while live:
        starts, batch, valid = _next_blocks(ids, live, block, mask_id, [0] * len(live))  # [R, T] each
        commit = torch.tensor(starts)  # [R]
        while True:
            masked = (batch == mask_id) & valid  # [R, T]
            if not masked.any():
                break
            position, token = _surest(denoise(model, batch, commit, valid), masked, mask_id)  # [R], [R]
            rows = masked.any(-1).nonzero().flatten()
            batch[rows, position[rows]] = token[rows]
        for i, r in enumerate(live):
            ids[r][starts[i] :] = batch[i, starts[i] : starts[i] + block].tolist()
        live = _end_blocks(ids, prompts, live, eos, answers)
    return answers


@torch.no_grad()
def cached_greedy_answers(
    model: Any, prompts: list[list[int]], block: int, mask_id: int, eos: set[int]
) -> list[list[int] | None]:
    """``greedy_answers``' decode as the engine runs it, with the committed tokens in a cache: a
    block's first pass commits what its row has not committed yet (the prompt up to the block, or
    the block before) and previews the block, its other passes preview the block alone against
    the cache. The same passes in exact arithmetic (the prefix is committed in other chunks, so a
    near tie may resolve otherwise in float32; none did in the tests' cases), about a block's
    width of tokens a pass instead of the whole prefix. Clover only: the cache of committed state
    is its."""
    if model.config.family != "clover":
        raise ValueError(f"a cache of committed state is Clover's; this model is {model.config.family}")
    weight = next(model.parameters())
    n = len(prompts)
    # committed: at most the longest prompt + MAX_ANSWER; a pass adds at most 2 blocks beyond it
    cache = model.new_cache(max_seqs=n, max_len=max(map(len, prompts)) + MAX_ANSWER + 2 * block,
                            device=weight.device, dtype=weight.dtype)  # fmt: skip
    slots = torch.tensor([cache.allocate() for _ in range(n)])  # [N]
    ids = [list(p) for p in prompts]
    committed = [0] * n  # positions of each row in the cache
    answers: list[list[int] | None] = [None] * n
    live = list(range(n))
    while live:
        offsets = [committed[r] for r in live]
        # [R, W]: the uncommitted prefix, then the block (at least one mask: the first pass runs)
        starts, batch, valid = _next_blocks(ids, live, block, mask_id, offsets)
        commit = [start - offset for start, offset in zip(starts, offsets, strict=True)]
        at = torch.tensor(commit)[:, None] + torch.arange(block)  # [R, b] the block's columns
        positions = torch.tensor(offsets)[:, None] + torch.arange(batch.shape[1])  # [R, W]
        commits = torch.tensor(commit)  # [R]: the first pass commits, the others preview only
        rows = torch.arange(len(live))[:, None]  # [R, 1]
        while True:
            masked = batch[rows, at] == mask_id  # [R, b]
            if not masked.any():
                break
            logits = model(batch, positions, valid=valid, cache=cache, slots=slots[live],
                           commit_lens=commits, logits_index=at)  # [R, b, V] fmt: skip
            position, token = _surest(logits, masked, mask_id)  # [R], [R]
            going = masked.any(-1).nonzero().flatten()
            batch[going, at[going, position[going]]] = token[going]
            if commits.any():  # from now on the block alone, previewed against the cache
                batch, valid = batch[rows, at], torch.ones(len(live), block, dtype=torch.bool)
                positions = torch.tensor(starts)[:, None] + torch.arange(block)  # [R, b]
                at = torch.arange(block).expand(len(live), -1)
                commits = torch.zeros_like(commits)
        for i, r in enumerate(live):
            committed[r] = starts[i]  # what the block's first pass committed
            ids[r][starts[i] :] = batch[i, at[i]].tolist()
        live = _end_blocks(ids, prompts, live, eos, answers)
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
    cached: bool = False,
) -> list[Row]:
    """The pool of the stage: one row per generation case of the training ``split`` whose own
    answer ends (at most ``count``), in case order; ``cached``: decoded by
    ``cached_greedy_answers``."""
    model.eval()
    eos = set(tokenizer.eos_token_ids)
    cases = [generation_case(split, seed, i, headings) for i in range(count)]
    prompts = [generation_prompt(case, tokenizer) for case in cases]
    rows: list[Row] = []
    decode = cached_greedy_answers if cached else greedy_answers
    for first in range(0, count, BATCH):
        chunk = prompts[first : first + BATCH]
        for prompt, answer in zip(chunk, decode(model, chunk, block, mask_id, eos), strict=True):
            if answer is not None:
                rows.append(replace(answer_row(prompt, answer, tokenizer, block), whole=True))
    if not rows:
        raise ValueError(f"none of the {count} answers of the pool ended within {MAX_ANSWER} tokens")
    return rows
