"""Request/response types of the engine: the contract between the job system and the sampler.

These are plain dataclasses (no torch, no Celery) so the worker's Celery task can build a
request from a job row and turn a result back into a job outcome without touching tensors.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal


class FinishReason(enum.StrEnum):
    """Why a sequence stopped."""

    EOS = "eos"  # an EOS token was committed; output cut at the first EOS
    LENGTH = "length"  # max_new_tokens reached
    BUDGET = "budget"  # the step budget (denoising passes) ran out
    CANCELLED = "cancelled"  # the caller cancelled it
    DEADLINE = "deadline"  # its deadline passed
    ERROR = "error"  # it failed (see GenerationResult.error)


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one sequence (the decoding contract: docs/architecture.md, section 3.7).

    ``None`` means the model family's default (``worker.model.family.decoding_defaults``): SDAR
    decodes 4 steps per block, static, threshold 0.9; Clover as many steps as the block has
    positions, dynamic, threshold 0.95. The engine fills them in at submit.
    """

    max_new_tokens: int = 128
    block_size: int | None = None  # None: the checkpoint's block size
    steps_per_block: int | None = None
    strategy: Literal["static", "dynamic"] | None = None
    threshold: float | None = None  # dynamic strategy only
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    step_budget: int | None = None  # max denoising passes for the whole request; None: unbounded


@dataclass(frozen=True)
class InfillSlot:
    """A span of masked positions inside a template, optionally restricted.

    ``start`` is relative to the start of the template. ``allowed_sequences`` lists the token
    sequences the span may hold (each exactly ``length`` long after padding with the template's
    pad id); ``None`` means any token. ``allowed_token_ids`` restricts every position of the span
    to those ids (each position decoded on its own); a span with ``allowed_sequences`` is
    committed as one unit, choosing the sequence with the highest summed log-probability.

    ``pad_tail``: the span is room for a value that may be shorter (a structured output's
    string or digits): every offset may also take the template's ``pad_id``, except the first
    ``min_tokens``, and the sampler's pad-tail rule (``worker/sampler/pad_tail.py``) keeps the
    pads one contiguous tail. Needs ``allowed_token_ids`` (the content ids) and a ``pad_id``.
    """

    start: int
    length: int
    allowed_sequences: tuple[tuple[int, ...], ...] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    pad_tail: bool = False
    min_tokens: int = 0


@dataclass(frozen=True)
class SlotConstraint:
    """Restricted slots whose choices must agree: only the listed combinations are allowed.

    ``slots``: template slot indexes (each with ``allowed_sequences``); ``allowed``: per allowed
    combination, one candidate index (into that slot's ``allowed_sequences``) per slot. A slot
    belongs to at most one constraint. The sampler picks a constrained slot's choice as the best
    allowed combination given the slots already decided and the scores of those decided with it
    (``worker/sampler/constraints.py``), so the answers never break it.
    """

    slots: tuple[int, ...]
    allowed: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class InfillTemplate:
    """Structured output: fixed tokens plus masked slots; only slots are denoised."""

    token_ids: tuple[int, ...]  # full template; slot positions hold anything (they are masked)
    slots: tuple[InfillSlot, ...]
    pad_id: int | None = None  # filler for allowed sequences shorter than their slot
    # Decide every restricted slot in ONE pass over one span: the blocks from the first slot's
    # block to the last slot's block are denoised together, every slot masked, the prefix up to
    # the span committed (``worker/sampler/sequence.py``). A joint decision decoded as a model
    # trained with ``--parallel-slots`` saw it; one pass instead of one per slot block. Needs every
    # slot restricted (``allowed_sequences``): free text cannot be written in one pass.
    one_pass: bool = False
    # restricted slots whose choices must agree (a joint decision's declared constraints); the
    # layout checks them and keeps them over its own sequence-slot indexes
    constraints: tuple[SlotConstraint, ...] = ()


@dataclass
class Progress:
    """Snapshot reported by the engine while a request runs."""

    blocks_done: int
    steps_used: int
    step_budget: int | None
    tokens_committed: int
    committed_token_ids: list[int]


@dataclass
class GenerationRequest:
    """One sequence to decode. ``prompt_ids`` is already tokenized (chat template applied)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    template: InfillTemplate | None = None
    slot_class: str = "standard"  # engine slot-cap class (e.g. "joint" is capped)
    deadline: float | None = None  # time.monotonic() value after which it stops
    on_progress: Callable[[Progress], None] | None = None
    cancel_event: threading.Event = field(default_factory=threading.Event)


@dataclass
class SlotChoice:
    """Which allowed sequence an infill slot took, and how sure the model was."""

    index: int  # index into InfillSlot.allowed_sequences (or -1 if unrestricted)
    token_ids: list[int]
    confidence: float  # probability of the chosen sequence, normalised over the allowed ones


@dataclass
class GenerationResult:
    """Outcome of one request."""

    request_id: str
    token_ids: list[int]  # generated ids (template region for infill), cut at the first EOS
    finish_reason: FinishReason
    steps_used: int
    blocks: int
    tokens: int  # len(token_ids)
    prompt_tokens: int
    slot_choices: list[SlotChoice] = field(default_factory=list)
    queue_seconds: float = 0.0  # submit -> its first denoising pass began (admission if none ran)
    run_seconds: float = 0.0  # that instant -> finished
    error: str | None = None
