"""A synthetic contract of about N tokens for the long-context tests (issue 26)."""

from __future__ import annotations

from collections.abc import Callable

QUESTIONS = [{"id": "deliver", "text": "Must the supplier deliver within sixty days?"},
             {"id": "notice", "text": "Is written notice required?"}]


def _clause(i: int) -> str:
    return f"{i}. The Supplier shall deliver the Goods within {i % 60 + 1} days of each written order. "


def contract(count: Callable[[str], int], tokens: int) -> str:
    """Numbered clauses while the text's ``count`` (a tokenizer's) stays within ``tokens``: the
    result is ``tokens`` or less than one clause below it. Clauses alone count at least what they
    count joined (BPE merges across their boundary), so filling by their own counts never passes
    ``tokens``; a few exact counts of the whole text close the gap."""
    text, i = "", 0
    while (room := tokens - count(text)) > 2 * count(_clause(i)):
        while (cost := count(_clause(i))) <= room:
            text, room, i = text + _clause(i), room - cost, i + 1
    while count(text + _clause(i)) <= tokens:
        text, i = text + _clause(i), i + 1
    return text
