"""Infill templates whose fixed tokens are JSON syntax and whose slots are the answers.

A joint answer region reads ``[{"id": "q1", "choice": <slot>}, {"id": "q2", ...}]``; an
independent one is a single ``{"id": ..., "choice": <slot>}`` object. Each choice slot is
restricted to the JSON-encoded choices of its question (padded to one length), so whatever the
model does the region decodes to valid JSON with one allowed choice per question. An optional
rationale is an unrestricted free-text slot inside a JSON string; it is validated afterwards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from worker.decisions.spec import DecisionQuestion, DecisionTokenizer
from worker.decisions.validation import rationale_problem
from worker.engine.types import InfillSlot, InfillTemplate


@dataclass(frozen=True)
class AnswerLayout:
    """Where one question's answer lives in a template (indices into ``template.slots``)."""

    question_index: int
    choice_slot: int
    rationale_slot: int | None


@dataclass(frozen=True)
class AnswerTemplate:
    """A template plus the map from its slots back to the questions."""

    template: InfillTemplate
    answers: tuple[AnswerLayout, ...]


class _Builder:
    """Appends fixed text and masked slots, tracking slot offsets in template tokens."""

    def __init__(self, tokenizer: DecisionTokenizer, pad_id: int) -> None:
        self._tokenizer = tokenizer
        self._pad_id = pad_id
        self.ids: list[int] = []
        self.slots: list[InfillSlot] = []

    def text(self, fragment: str) -> None:
        self.ids.extend(self._tokenizer.encode(fragment))

    def slot(
        self, length: int, allowed: tuple[tuple[int, ...], ...] | None, tokens: tuple[int, ...] | None = None
    ) -> int:
        self.slots.append(
            InfillSlot(
                start=len(self.ids), length=length, allowed_sequences=allowed, allowed_token_ids=tokens
            )
        )
        self.ids.extend([self._pad_id] * length)
        return len(self.slots) - 1


@lru_cache(maxsize=4)
def safe_text_token_ids(tokenizer: DecisionTokenizer) -> tuple[int, ...]:
    """Ids whose text is safe inside a JSON string: printable, non-empty, whole characters,
    no quote or backslash, not special. Rationale positions are restricted to these, so the
    free text almost always validates; validation still runs (emptiness, length).

    One pass over the vocabulary per tokenizer (cached): setup work, not per-request.
    """
    texts = ((i, tokenizer.decode([i], skip_special_tokens=True)) for i in range(tokenizer.vocab_size))
    return tuple(
        i for i, text in texts if text == " " or rationale_problem(text, max_chars=len(text)) is None
    )


def choice_sequences(
    question: DecisionQuestion, tokenizer: DecisionTokenizer, pad_id: int
) -> tuple[tuple[int, ...], ...]:
    """The JSON-string token sequences of a question's choices, padded to one length."""
    encoded = [tokenizer.encode(json.dumps(choice)) for choice in question.choices]
    length = max(len(seq) for seq in encoded)
    return tuple(tuple(seq + [pad_id] * (length - len(seq))) for seq in encoded)


def _answer_object(
    builder: _Builder,
    question_index: int,
    question: DecisionQuestion,
    tokenizer: DecisionTokenizer,
    pad_id: int,
    rationale_tokens: int | None,
) -> AnswerLayout:
    allowed = choice_sequences(question, tokenizer, pad_id)
    builder.text('{"id": ' + json.dumps(question.id) + ', "choice": ')
    choice_slot = builder.slot(len(allowed[0]), allowed)
    rationale_slot = None
    if rationale_tokens is not None:
        builder.text(', "rationale": "')
        rationale_slot = builder.slot(rationale_tokens, None, safe_text_token_ids(tokenizer))
        builder.text('"')
    builder.text("}")
    return AnswerLayout(question_index, choice_slot, rationale_slot)


def answer_template(
    questions: tuple[DecisionQuestion, ...],
    *,
    first_index: int,
    tokenizer: DecisionTokenizer,
    pad_id: int,
    rationale_tokens: int | None,
    as_list: bool,
    one_pass: bool = False,
) -> AnswerTemplate:
    """Build the template for ``questions`` (a JSON list when ``as_list``, else one object).

    ``first_index`` is the position of ``questions[0]`` in the whole decision, so layouts of
    independent templates still point at the right question. ``one_pass``: every choice decided
    in one pass (``InfillTemplate.one_pass``; no rationale slots).
    """
    builder = _Builder(tokenizer, pad_id)
    layouts: list[AnswerLayout] = []
    if as_list:
        builder.text("[")
    for offset, question in enumerate(questions):
        if offset:
            builder.text(", ")
        layouts.append(
            _answer_object(builder, first_index + offset, question, tokenizer, pad_id, rationale_tokens)
        )
    if as_list:
        builder.text("]")
    template = InfillTemplate(token_ids=tuple(builder.ids), slots=tuple(builder.slots), pad_id=pad_id,
                              one_pass=one_pass)
    return AnswerTemplate(template=template, answers=tuple(layouts))
