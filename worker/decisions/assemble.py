"""Engine results -> the decision result ``{"mode", "answers": [...]}`` in question order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker.decisions.planner import DecisionPlan
from worker.decisions.spec import DecisionTokenizer
from worker.decisions.templates import AnswerTemplate
from worker.decisions.validation import rationale_problem
from worker.engine.types import GenerationResult, SlotChoice


class InvalidModelOutput(Exception):
    """A free-text part of the answer failed validation (the choices never can)."""


class IncompleteOutput(Exception):
    """The engine stopped before the template was filled (e.g. the step budget ran out)."""


def _slot_choice_for(template: AnswerTemplate, result: GenerationResult, slot_index: int) -> SlotChoice:
    """The engine's choice record of one slot.

    ``slot_choices`` is aligned with the template's slots; an engine that only reports
    restricted slots is accepted too (aligned with the restricted ones, in order).
    """
    slots = template.template.slots
    if len(result.slot_choices) == len(slots):
        return result.slot_choices[slot_index]
    restricted = [i for i, slot in enumerate(slots) if slot.allowed_sequences is not None]
    if len(result.slot_choices) == len(restricted):
        return result.slot_choices[restricted.index(slot_index)]
    raise IncompleteOutput(
        f"engine reported {len(result.slot_choices)} slot choices for {len(slots)} slots"
    )


def _answers_of(
    plan: DecisionPlan,
    template: AnswerTemplate,
    result: GenerationResult,
    tokenizer: DecisionTokenizer,
    rationale_max_chars: int,
    corrupt_rationale: bool,
) -> list[dict[str, Any]]:
    tokens = result.token_ids
    if len(tokens) < len(template.template.token_ids):
        expected = len(template.template.token_ids)
        raise IncompleteOutput(f"template of {expected} tokens got {len(tokens)} ({result.finish_reason})")
    answers = []
    for layout in template.answers:
        question = plan.spec.questions[layout.question_index]
        slot = template.template.slots[layout.choice_slot]
        allowed = slot.allowed_sequences or ()
        filled = tuple(tokens[slot.start : slot.start + slot.length])
        if filled not in allowed:  # the engine broke its contract: never emit a wrong answer
            raise IncompleteOutput(f"slot of question {question.id!r} holds no allowed choice")
        index = allowed.index(filled)
        choice = _slot_choice_for(template, result, layout.choice_slot)
        answer: dict[str, Any] = {
            "id": question.id,
            "choice": question.choices[index],
            "confidence": round(float(choice.confidence), 6),
        }
        if layout.rationale_slot is not None:
            free = template.template.slots[layout.rationale_slot]
            text = tokenizer.decode(tokens[free.start : free.start + free.length], skip_special_tokens=True)
            if corrupt_rationale:  # test-only fault knob: make validation fail
                text = 'broken "rationale\\'
            problem = rationale_problem(text, max_chars=rationale_max_chars)
            if problem is not None:
                raise InvalidModelOutput(f"question {question.id!r}: {problem}")
            answer["rationale"] = text.strip()
        answers.append(answer)
    return answers


def assemble_result(
    plan: DecisionPlan,
    results: Sequence[GenerationResult],
    tokenizer: DecisionTokenizer,
    *,
    rationale_max_chars: int,
    corrupt_rationale: bool = False,
) -> dict[str, Any]:
    """The decision result, answers in question order.

    Raises ``InvalidModelOutput`` when a rationale fails validation and ``IncompleteOutput``
    when a template was not filled.
    """
    by_question: dict[int, dict[str, Any]] = {}
    for template, result in zip(plan.templates, results, strict=True):
        answers = _answers_of(plan, template, result, tokenizer, rationale_max_chars, corrupt_rationale)
        for layout, answer in zip(template.answers, answers, strict=True):
            by_question[layout.question_index] = answer
    ordered = [by_question[i] for i in range(len(plan.spec.questions))]
    return {"mode": plan.spec.mode, "answers": ordered}
