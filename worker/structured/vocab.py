"""Token classes a slot may draw from, computed once per tokenizer (one pass over the vocabulary).

String content tokens decode to whole printable characters with no quote, backslash or control
character, so any sequence of them is the inside of a valid JSON string that needs no escaping;
digit tokens decode to exactly one ASCII digit.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Protocol


class CanvasTokenizer(Protocol):
    """What the canvas needs of a tokenizer (``worker.model.tokenizer.Tokenizer`` has it)."""

    vocab_size: int
    pad_token_id: int
    mask_token_id: int
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def __hash__(self) -> int: ...


def _is_content(text: str) -> bool:
    return bool(text) and all(ch.isprintable() and ch not in '"\\\ufffd' for ch in text)


@lru_cache(maxsize=8)
def token_texts(tokenizer: CanvasTokenizer) -> tuple[str, ...]:
    """Each id's text ("" for special ids, which no slot may take)."""
    special = {tokenizer.pad_token_id, tokenizer.mask_token_id, *tokenizer.eos_token_ids}
    out = []
    for i in range(tokenizer.vocab_size):
        # special ids (chat markup, think tags) decode to "" with skip_special_tokens
        out.append("" if i in special else tokenizer.decode([i], skip_special_tokens=True))
    return tuple(out)


@lru_cache(maxsize=64)
def string_ids(tokenizer: CanvasTokenizer, max_chars: int, exclude: str = "") -> tuple[int, ...]:
    """Ids whose text is JSON-string content of at most ``max_chars`` characters (and holds
    none of ``exclude``, e.g. ``<`` inside an XML parameter)."""
    return tuple(
        i
        for i, text in enumerate(token_texts(tokenizer))
        if _is_content(text) and len(text) <= max_chars and not any(ch in text for ch in exclude)
    )


@lru_cache(maxsize=16)
def digit_ids(tokenizer: CanvasTokenizer, digits: str) -> tuple[int, ...]:
    """Ids whose text is exactly one of ``digits``."""
    ids = tuple(i for i, text in enumerate(token_texts(tokenizer)) if len(text) == 1 and text in digits)
    if {token_texts(tokenizer)[i] for i in ids} != set(digits):
        raise ValueError(f"the tokenizer lacks single-token digits {digits!r}")
    return ids


def decode_content(tokenizer: CanvasTokenizer, ids: Sequence[int], pad_id: int) -> str:
    """A slot's text: its tokens without the pads."""
    return tokenizer.decode([t for t in ids if t != pad_id], skip_special_tokens=True)
