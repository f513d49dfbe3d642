"""How long a sequence may be on this deployment: the checkpoint's context, capped by the
operator, and what the engine's memory holds (issue 26).

Every number a long prompt is judged by is decided here, from ``Settings`` and the checkpoint's
``config.json`` (``scheduler.fleet.checkpoint_context``), for the API's submit check
(``api/context_checks.py``, ``api/limits.py``) and the worker's engine (``worker/resident_model.py``):

- **prompt tokens**: ``min(max_position_embeddings, CLOVERQ_MAX_PROMPT_TOKENS)``; the setting's
  default (16,384) lets a newcomer send a 16K-token contract to ``cloverq up``'s demo (131,072).
- **positions per sequence** (the engine's ``max_len``, preallocated per slot): ``engine.max_len``
  (default: room for the largest accepted request), never beyond the checkpoint's context.
- **memory**: a sequence's footprint, its positions plus its fixed GDN state counted as positions
  of the same bytes, must fit the engine's K/V budget, ``CLOVERQ_ENGINE_MAX_TOKENS_IN_FLIGHT``
  positions (the engine refuses a larger one: ``Engine._footprint``). Bytes come from the one
  formula of ``scheduler.fleet.sequence_memory``.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.fleet.checkpoint_context import CheckpointContext
from scheduler.fleet.sequence_memory import SequenceMemory
from scheduler.infra.settings import Settings


@dataclass(frozen=True)
class ContextLimits:
    """The limits of one deployment on one checkpoint (``checkpoint_positions`` None: unknown)."""

    prompt_tokens: int  # the effective prompt cap
    setting_prompt_tokens: int  # limits.max_prompt_tokens (CLOVERQ_MAX_PROMPT_TOKENS)
    checkpoint_positions: int | None  # max_position_embeddings
    sequence_positions: int  # the engine's positions per sequence (max_len)
    setting_sequence_positions: int  # Settings.resolved_engine_max_len
    budget_positions: int  # engine.max_tokens_in_flight: K/V positions all sequences hold at once
    memory: SequenceMemory | None  # what one sequence holds; None without a checkpoint

    @classmethod
    def resolve(cls, settings: Settings, checkpoint: CheckpointContext | None) -> ContextLimits:
        """The limits of ``settings`` on ``checkpoint`` (None: the settings alone)."""
        prompt, sequence = settings.limits.max_prompt_tokens, settings.resolved_engine_max_len
        context = checkpoint.max_positions if checkpoint is not None else None
        return cls(
            prompt_tokens=prompt if context is None else min(prompt, context),
            setting_prompt_tokens=prompt,
            checkpoint_positions=context,
            sequence_positions=sequence if context is None else min(sequence, context),
            setting_sequence_positions=sequence,
            budget_positions=settings.engine.max_tokens_in_flight,
            memory=checkpoint.memory if checkpoint is not None else None,
        )

    @property
    def prompt_limited_by_checkpoint(self) -> bool:
        """The checkpoint's context, not the setting, bounds prompts (raising the setting won't help)."""
        return self.prompt_tokens < self.setting_prompt_tokens

    @property
    def sequence_limited_by_checkpoint(self) -> bool:
        return self.sequence_positions < self.setting_sequence_positions

    def footprint_positions(self, positions: int) -> int:
        """What a sequence of ``positions`` positions holds against the budget, in positions."""
        return positions + (self.memory.state_positions() if self.memory is not None else 0)

    def fits_memory(self, positions: int) -> bool:
        """Whether one sequence of ``positions`` positions fits the engine's K/V budget."""
        return self.footprint_positions(positions) <= self.budget_positions

    def max_fitting_positions(self) -> int:
        """The longest sequence (positions) the budget and the per-sequence room both hold."""
        return max(0, min(self.sequence_positions, self.budget_positions - self.footprint_positions(0)))

    def needed_bytes(self, positions: int) -> int | None:
        """Bytes one sequence of ``positions`` positions holds (None without a checkpoint)."""
        return None if self.memory is None else int(self.memory.sequence_bytes(positions))

    def budget_bytes(self) -> int | None:
        """Bytes of the engine's K/V budget (None without a checkpoint)."""
        return None if self.memory is None else int(self.budget_positions * self.memory.bytes_per_position())
