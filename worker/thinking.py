"""Split a thinking-mode generation into ``reasoning`` and the answer ``text``.

With thinking on, the model writes ``<think>reasoning</think>answer``; the chat template may
already have emitted ``<think>`` in the prompt, so only ``</think>`` is required to find the
split. A generation that never closed its thinking has no answer yet: all of it is reasoning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ThinkingSplit:
    """The two parts of a thinking-mode output."""

    reasoning: str
    text: str


def split_thinking(
    token_ids: Sequence[int],
    *,
    think_start_id: int,
    think_end_id: int,
    decode: Callable[[Sequence[int]], str],
) -> ThinkingSplit:
    """Split generated ids at the first ``</think>`` (reasoning without the think markers)."""
    ids = list(token_ids)
    start = ids.index(think_start_id) + 1 if think_start_id in ids else 0
    if think_end_id not in ids[start:]:
        return ThinkingSplit(reasoning=decode(ids[start:]).strip(), text="")
    end = ids.index(think_end_id, start)
    return ThinkingSplit(reasoning=decode(ids[start:end]).strip(), text=decode(ids[end + 1 :]).strip())


class ThinkingTokenizer(Protocol):
    think_start_id: int | None
    think_end_id: int | None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def thinking_fields(token_ids: Sequence[int], tokenizer: ThinkingTokenizer) -> dict[str, Any]:
    """``{"reasoning", "text"}`` for a thinking-mode result (replaces the raw ``text``)."""
    if tokenizer.think_start_id is None or tokenizer.think_end_id is None:
        return {"reasoning": None}  # this checkpoint has no thinking markers: text stays as is
    split = split_thinking(
        token_ids, think_start_id=tokenizer.think_start_id, think_end_id=tokenizer.think_end_id,
        decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
    )
    return {"reasoning": split.reasoning, "text": split.text}
