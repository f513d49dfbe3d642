"""The decoding contract as one plain loop: prompt -> blocks -> passes -> commits, for ONE sequence.

Read this before ``engine.py``. The engine decodes many sequences at once, keeps every committed
block in a KV (and, for Clover, recurrent-state) cache, fuses passes and moves one tensor per
pass between host and device; all of that is speed. What it must compute is this file: the
contract of ``shared/DESIGN.md`` ("Block-diffusion decoding") and ``docs/architecture.md`` §3.7,
written so that each rule is one visible line. The engine's tests hold its tokens equal to these
(``tests/unit/test_engine_decoding.py``), greedy and seeded-sampled, on both families.

What it leaves out on purpose: batching, the cache (every pass recomputes the whole prefix with
the model's public forward, ``block_logits``), prefix sharing, templates and infill slots (a plain
generate request only), progress reports. It is slow (a pass costs the whole prefix) and is meant
for tests, the bench's equal-work comparison and reading.

The rules, in the order the loop applies them:

1. The region to generate starts right after the prompt and is rounded up to whole blocks
   (block ``b`` holds positions ``b*B .. b*B+B-1``); every position of it starts as the mask token.
   The prompt's last, partial block is the first block decoded (its prompt tokens stay fixed).
2. At the start of a block with ``m`` masks and ``S`` steps the quotas are ``m // S``, plus one
   for the first ``m % S`` steps; zero quotas are dropped. A step budget that cannot pay ``S``
   passes for every block left lowers ``S`` for this block (never below 1); with no pass left at
   all the request ends (``budget``).
3. Each pass predicts every position of the block. The mask token is never a prediction.
   Temperature 0 takes the argmax; otherwise the logits are divided by the temperature, then
   top-k, then top-p remove tokens, and one seeded uniform per block position draws the token
   by inverse CDF. Confidence is the chosen token's probability under that (filtered)
   distribution.
4. ``static`` commits the ``k`` most confident masks; ``dynamic`` commits every mask whose
   confidence is strictly above the threshold when there are at least ``k`` of them, else the
   ``k`` most confident. Equal confidences go to the lower position. A block whose masks are all
   committed is done (its remaining quotas are skipped).
5. After a block, generation stops if an EOS token was committed in the output so far (``eos``),
   or when the region is done (``length``). The output is cut to ``max_new_tokens`` and before
   its first EOS. A block whose output positions up to a committed EOS are all committed ends
   with that pass: the passes that would fill the masks after the EOS cannot change the output.

The random draws match the engine's exactly: one ``torch.Generator`` seeded with the request's
seed, and ``torch.rand(B)`` per pass (one uniform per block position, prompt positions included),
which is why a seeded request gives the same tokens here, alone in the engine or in any batch.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from worker.engine.types import FinishReason, SamplingParams
from worker.model.family import DiffusionModel


@dataclass(frozen=True)
class ReferenceResult:
    """What the engine's ``GenerationResult`` reports for the same request, and no more."""

    token_ids: list[int]  # cut to max_new_tokens and before the first EOS
    steps_used: int  # denoising passes
    blocks: int  # blocks completed
    finish_reason: FinishReason  # EOS, LENGTH or BUDGET


def block_logits(model: DiffusionModel, seqs: torch.Tensor, lo: int, hi: int, block: int) -> torch.Tensor:
    """Logits ``[B, hi - lo, V]`` of positions ``lo..hi-1`` given ``seqs[:, :hi]`` (no cache carried).

    For SDAR and LLaDA2 it is one forward over the whole prefix under the block-causal mask. For
    Clover it is a fresh state cache, the causal commit of every position before the block and the
    preview of the block, in one forward: nothing carried over from earlier passes. Batched over
    rows only because the bench times many sequences with it; the reference passes one.
    """
    b = seqs.shape[0]
    pos = torch.arange(hi).expand(b, -1)  # [B, hi]
    if model.config.family != "clover":
        return model(seqs[:, :hi], pos, pos // block)[:, lo:hi]
    param = next(model.parameters())
    cache = model.new_cache(max_seqs=b, max_len=hi, device=param.device, dtype=param.dtype)
    slots = torch.tensor([cache.allocate() for _ in range(b)])
    index = torch.arange(lo, hi).expand(b, -1)  # [B, hi - lo]
    return model(
        seqs[:, :hi],
        pos,
        pos // block,
        cache=cache,
        slots=slots,
        commit_lens=torch.full((b,), lo),
        logits_index=index,
    )


def step_quotas(masks: int, steps: int) -> list[int]:
    """Rule 2: ``masks // steps`` per step, one more for the first ``masks % steps``, zeros dropped."""
    return [q for q in (masks // steps + (1 if i < masks % steps else 0) for i in range(steps)) if q > 0]


def steps_for_block(steps_per_block: int, blocks_left: int, budget_left: int | None) -> int:
    """Rule 2's budget: ``steps_per_block`` while the budget can pay it for every block left, else the
    passes left spread evenly (at least 1); 0 when none is left."""
    if budget_left is None or budget_left >= steps_per_block * blocks_left:
        return steps_per_block
    return 0 if budget_left <= 0 else max(1, budget_left // blocks_left)


def choose_token(
    logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float, uniform: float
) -> tuple[int, float]:
    """Rule 3 for one position: ``logits`` [V] (mask token already at -inf) -> (token, confidence)."""
    if temperature > 0:
        logits = logits / temperature  # [V]
    if top_k > 0 or top_p < 1.0:
        order = torch.sort(logits, descending=True, stable=True).indices  # [V] best first, ties by id
        ranked = logits[order]  # [V]
        removed = torch.zeros_like(ranked, dtype=torch.bool)  # [V] in ranked order
        if top_k > 0:
            removed[top_k:] = True
        probs = torch.softmax(ranked.masked_fill(removed, float("-inf")), dim=-1)  # [V]
        if top_p < 1.0:  # a token goes when the tokens before it already hold more than top_p
            removed |= (probs.cumsum(dim=-1) - probs) > top_p
        logits = logits.clone()
        logits[order[removed]] = float("-inf")
    probs = torch.softmax(logits, dim=-1)  # [V]
    if temperature > 0:  # inverse CDF: the first token whose cumulative mass passes u * total
        cdf = probs.cumsum(dim=-1)  # [V]
        target = torch.tensor([uniform], dtype=cdf.dtype) * cdf[-1]
        token = min(int(torch.searchsorted(cdf, target, right=True)), probs.shape[0] - 1)
    else:
        token = int(logits.argmax())  # the first of equal maxima
    return token, float(probs[token])


def choose_commits(
    confidence: dict[int, float], quota: int, *, dynamic: bool, threshold: float
) -> list[int]:
    """Rule 4: ``confidence`` of each still-masked position -> the positions to commit."""
    ranked = sorted(confidence, key=lambda p: (-confidence[p], p))  # most confident, then lower position
    if dynamic:
        above = [p for p in ranked if confidence[p] > threshold]
        if len(above) >= quota:
            return above
    return ranked[:quota]


def reference_decode(
    model: DiffusionModel,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    mask_token_id: int,
    eos_token_ids: Collection[int],
) -> ReferenceResult:
    """Decode one plain request exactly as the contract says; ``params`` must be resolved (block size,
    steps per block and strategy given, as the engine fills them in at submit)."""
    block, steps_per_block, strategy = params.block_size, params.steps_per_block, params.strategy
    if block is None or steps_per_block is None or strategy is None:
        raise ValueError("reference_decode needs block_size, steps_per_block and strategy resolved")
    threshold = params.threshold if params.threshold is not None else 1.0
    top_k, top_p = params.top_k or 0, params.top_p if params.top_p is not None else 1.0
    generator = torch.Generator(device="cpu")
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()

    # Rule 1: the sequence is the prompt, then the region of whole blocks, all masks.
    start, new = len(prompt_ids), params.max_new_tokens
    end = -(-(start + new) // block) * block
    seq = list(prompt_ids) + [mask_token_id] * (end - start)
    steps_used = blocks = 0
    finish = FinishReason.LENGTH
    first_block, last_block = start // block, end // block  # blocks first_block .. last_block - 1
    for b in range(first_block, last_block):
        lo, hi = b * block, (b + 1) * block
        # Rule 2: this block's passes and quotas.
        budget_left = None if params.step_budget is None else params.step_budget - steps_used
        steps = steps_for_block(steps_per_block, last_block - b, budget_left)
        if steps == 0:
            finish = FinishReason.BUDGET
            break
        for quota in step_quotas(sum(1 for p in range(lo, hi) if seq[p] == mask_token_id), steps):
            masked = [p for p in range(lo, hi) if seq[p] == mask_token_id]
            if not masked:  # dynamic committed ahead of the quotas: the block is done
                break
            uniforms = torch.rand(block, generator=generator) if params.temperature > 0 else None  # [B]
            # Rule 3: one forward over the whole prefix, logits of this block's positions.
            logits = block_logits(model, torch.tensor([seq[:hi]]), lo, hi, block)[0].float()  # [B, V]
            logits[:, mask_token_id] = float("-inf")
            confidence: dict[int, float] = {}
            chosen: dict[int, int] = {}
            for p in masked:
                u = float(uniforms[p - lo]) if uniforms is not None else 0.0
                chosen[p], confidence[p] = choose_token(
                    logits[p - lo], temperature=params.temperature, top_k=top_k, top_p=top_p, uniform=u
                )
            # Rule 4: commit.
            commits = choose_commits(confidence, min(quota, len(masked)), dynamic=strategy == "dynamic",
                                     threshold=threshold)  # fmt: skip
            for p in commits:
                seq[p] = chosen[p]
            steps_used += 1
            if _settled(seq[max(lo, start) : min(hi, start + new)], mask_token_id, eos_token_ids):
                break  # Rule 5: the output ends at this EOS whatever the other masks become
        blocks += 1
        # Rule 5: stop after the block holding an EOS (within the output), or at the region's end.
        if any(t in eos_token_ids for t in seq[start : min(hi, start + new)]):
            finish = FinishReason.EOS
            break

    out: list[int] = []
    for t in seq[start : start + new]:
        if t == mask_token_id or t in eos_token_ids:  # a budget stop leaves masks; EOS cuts
            break
        out.append(t)
    return ReferenceResult(out, steps_used, blocks, finish)


def _settled(block: Sequence[int], mask_token_id: int, eos_token_ids: Collection[int]) -> bool:
    """Rule 5's early end: an EOS with no mask before it in the block's output positions."""
    for t in block:
        if t == mask_token_id:
            return False
        if t in eos_token_ids:
            return True
    return False
