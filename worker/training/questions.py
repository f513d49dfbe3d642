"""Question groups whose answers are logically tied, with the rule that ties them.

Every group asks two questions about one premise of a contract; the true answers follow from
``ContractFacts`` and always satisfy the group's ``rule``. A model's answers that break the rule
are a consistency violation (``violates``), the check the launch checklist asks for on related
questions derived from one premise:

- ``gate``: the second question applies only when the first is "yes" ("not applicable" exactly
  when the first is "no"), e.g. "Is liability capped?" / "Is the cap at least EUR 1,000,000?";
- ``exclusive``: not both "yes" (two different governing laws);
- ``implies``: a "yes" to the first forces a "yes" to the second (paid within 14 days, so within 30);
- ``opposite``: exactly one "yes" (assign freely / consent needed).

A *value question* (``value_question``, rule ``value``: one question, nothing to tie) asks for the
clause's value itself, among all the values the corpus writes ("Which law governs the agreement?",
"Within how many days must invoices be paid?"). Training rows only (``TrainConfig.value_share``):
the answer is copied from one place of the contract, a signal each of its tokens carries alone,
while "Is it governed by the laws of France?" is answered by no single token (only the pair of
the question's country and the clause's tells), and a model trained on such comparisons alone
stays at its prior (docs/demo-training.md, fourth round).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from worker.training.contracts import (
    CAP_AMOUNTS,
    LAWS,
    NOTICE_DAYS,
    PAYMENT_DAYS,
    RENEWAL_YEARS,
    SURVIVAL_YEARS,
    ContractFacts,
    money,
    years,
)

YES, NO, NA = "yes", "no", "not applicable"
NONE = "none"  # a value question's answer when the contract has no such clause (or right)
YES_NO: tuple[str, ...] = (YES, NO)
YES_NO_NA: tuple[str, ...] = (YES, NO, NA)
Rule = Literal["gate", "exclusive", "implies", "opposite", "value"]


@dataclass(frozen=True)
class Question:
    text: str
    choices: tuple[str, ...]
    answer: str


@dataclass(frozen=True)
class QuestionGroup:
    kind: str  # the premise: liability, termination, renewal, ...
    rule: Rule
    questions: tuple[Question, ...]  # two tied questions; one for a value question


def violates(rule: Rule, first: str, second: str) -> bool:
    """Whether answers ``first`` / ``second`` to a group contradict each other under ``rule``."""
    if rule == "value":
        return False
    if rule == "gate":
        return (first == NO) != (second == NA)
    if rule == "exclusive":
        return first == YES and second == YES
    if rule == "implies":
        return first == YES and second != YES
    return (first == YES) == (second == YES)


def _yn(value: bool) -> str:
    return YES if value else NO


def _gated(applies: bool, value: bool) -> str:
    return _yn(value) if applies else NA


def _liability(f: ContractFacts, rng: random.Random) -> QuestionGroup:
    ra, limit = f.roles[0], rng.choice(CAP_AMOUNTS[1:4])
    return QuestionGroup("liability", "gate", (
        Question(f"Is the liability of the {ra} capped?", YES_NO, _yn(f.cap is not None)),
        Question(f"Is the liability cap at least {money(limit)}?", YES_NO_NA,
                 _gated(f.cap is not None, f.cap is not None and f.cap >= limit)),
    ))  # fmt: skip


def _termination(f: ContractFacts, rng: random.Random) -> QuestionGroup:
    rb, limit = f.roles[1], rng.choice(NOTICE_DAYS[1:4])
    return QuestionGroup("termination", "gate", (
        Question(f"May the {rb} terminate for convenience?", YES_NO, _yn(f.notice_days is not None)),
        Question(f"Is the notice period for termination longer than {limit} days?", YES_NO_NA,
                 _gated(f.notice_days is not None, f.notice_days is not None and f.notice_days > limit)),
    ))  # fmt: skip


def _renewal(f: ContractFacts, rng: random.Random) -> QuestionGroup:
    limit = rng.choice(RENEWAL_YEARS)
    return QuestionGroup("renewal", "gate", (
        Question("Does the agreement renew automatically?", YES_NO, _yn(f.renewal_years is not None)),
        Question(f"Is each renewal period at least {years(limit)}?", YES_NO_NA,
                 _gated(f.renewal_years is not None, (f.renewal_years or 0) >= limit)),
    ))  # fmt: skip


def _confidentiality(f: ContractFacts, rng: random.Random) -> QuestionGroup:
    limit = rng.choice(SURVIVAL_YEARS[1:])
    return QuestionGroup("confidentiality", "gate", (
        Question("Does the agreement impose confidentiality?", YES_NO, _yn(f.survival_years is not None)),
        Question(f"Does confidentiality last at least {years(limit)} after termination?", YES_NO_NA,
                 _gated(f.survival_years is not None, (f.survival_years or 0) >= limit)),
    ))  # fmt: skip


def _law(f: ContractFacts, rng: random.Random) -> QuestionGroup:
    others = [law for law in LAWS if law != f.law]
    pair = [f.law, rng.choice(others)] if rng.random() < 0.7 else rng.sample(others, 2)
    rng.shuffle(pair)
    return QuestionGroup("law", "exclusive", tuple(
        Question(f"Is the agreement governed by the laws of {law}?", YES_NO, _yn(law == f.law))
        for law in pair
    ))  # fmt: skip


def _payment(f: ContractFacts, rng: random.Random) -> QuestionGroup:
    low, high = sorted(rng.sample(PAYMENT_DAYS, 2))
    return QuestionGroup("payment", "implies", tuple(
        Question(f"Must invoices be paid within {d} days?", YES_NO, _yn(f.payment_days <= d))
        for d in (low, high)
    ))  # fmt: skip


def _assignment(f: ContractFacts, rng: random.Random) -> QuestionGroup:
    ra = f.roles[0]
    free = f.assignment == "free"
    pair = [
        Question(f"May the {ra} assign the agreement to anyone without consent?", YES_NO, _yn(free)),
        Question(f"Does an assignment by the {ra} to a third party need consent?", YES_NO, _yn(not free)),
    ]
    return QuestionGroup("assignment", "opposite", (pair[0], pair[1]))


GROUPS: dict[str, Callable[[ContractFacts, random.Random], QuestionGroup]] = {
    "liability": _liability,
    "termination": _termination,
    "renewal": _renewal,
    "confidentiality": _confidentiality,
    "law": _law,
    "payment": _payment,
    "assignment": _assignment,
}


def draw_groups(facts: ContractFacts, rng: random.Random, count: int) -> list[QuestionGroup]:
    """``count`` groups of different kinds about ``facts``."""
    return [GROUPS[kind](facts, rng) for kind in rng.sample(sorted(GROUPS), count)]



def _value(kind: str, f: ContractFacts) -> tuple[str, tuple[str, ...], str]:
    """(question, choices, answer) of ``kind``'s value question about ``f``."""
    ra, rb = f.roles
    if kind == "liability":
        return (
            f"What is the liability cap of the {ra}?",
            (*map(money, CAP_AMOUNTS), NONE),
            money(f.cap) if f.cap is not None else NONE,
        )
    if kind == "termination":
        return (
            f"How many days notice does the {rb} need to terminate for convenience?",
            (*map(str, NOTICE_DAYS), NONE),
            str(f.notice_days) if f.notice_days is not None else NONE,
        )
    if kind == "renewal":
        return (
            "How long is each automatic renewal?",
            (*map(years, RENEWAL_YEARS), NONE),
            years(f.renewal_years) if f.renewal_years is not None else NONE,
        )
    if kind == "confidentiality":
        return (
            "How long does confidentiality last after termination?",
            (*map(years, SURVIVAL_YEARS), NONE),
            years(f.survival_years) if f.survival_years is not None else NONE,
        )
    if kind == "law":
        return "Which law governs the agreement?", LAWS, f.law
    if kind == "payment":
        return (
            "Within how many days must invoices be paid?",
            tuple(map(str, PAYMENT_DAYS)),
            str(f.payment_days),
        )
    if kind == "assignment":
        return (
            f"To whom may the {ra} assign the agreement without consent?",
            ("anyone", "affiliates", "no one"),
            {"free": "anyone", "affiliates": "affiliates", "consent": "no one"}[f.assignment],
        )
    raise ValueError(f"no value question for {kind!r}")


def value_question(kind: str, facts: ContractFacts) -> QuestionGroup:
    """The value question of ``kind`` about ``facts``, as a one-question group (rule ``value``)."""
    text, choices, answer = _value(kind, facts)
    return QuestionGroup(kind, "value", (Question(text, choices, answer),))
