"""The demo corpus: deterministic, splits disjoint, every question group's answers consistent."""

from __future__ import annotations

import pytest

from tests.unit.wide_openings import EXTRA_OPENINGS
from worker.training.contracts import (
    CLAUSES,
    EXTRA_PHRASINGS,
    HELD_OUT_PHRASING,
    LAWS,
    ROLES,
    TRAIN_PHRASINGS,
    draw_facts,
    render_contract,
)
from worker.training.corpus import decision_cases, generation_cases, in_split, phrasings_of
from worker.training.questions import NA, NO, YES, violates


def test_the_same_split_seed_and_index_give_the_same_cases() -> None:
    assert decision_cases("train", 3, 20) == decision_cases("train", 3, 20)
    assert generation_cases("eval", 3, 20) == generation_cases("eval", 3, 20)
    assert decision_cases("train", 3, 20) != decision_cases("train", 4, 20)


def test_evaluation_contracts_never_share_facts_or_text_with_training() -> None:
    train = decision_cases("train", 0, 300) + decision_cases("train", 1, 300)
    evaluation = decision_cases("eval", 0, 150) + decision_cases("heldout", 0, 150)
    assert {c.context for c in train}.isdisjoint({c.context for c in evaluation})
    # by construction: the fact space is split, so no seed of training can draw an evaluation contract
    import random

    rng = random.Random(5)
    facts = [draw_facts(rng) for _ in range(400)]
    assert all(in_split(f, "train") != in_split(f, "eval") for f in facts)
    assert any(in_split(f, "eval") for f in facts) and any(in_split(f, "train") for f in facts)


def test_held_out_phrasings_never_appear_in_training_text() -> None:
    import random

    facts = draw_facts(random.Random(0))
    held = render_contract(facts, random.Random(1), (HELD_OUT_PHRASING,)).splitlines()
    train_lines = {
        line.split(". ", 1)[-1] for c in decision_cases("train", 0, 400) for line in c.context.splitlines()
    }
    wide_lines = {
        line.split(". ", 1)[-1]
        for c in decision_cases("train_wide", 0, 400)
        for line in c.context.splitlines()
    }
    assert HELD_OUT_PHRASING not in TRAIN_PHRASINGS + EXTRA_PHRASINGS
    assert all(line.split(". ", 1)[-1] not in train_lines | wide_lines for line in held)


def test_the_wide_training_split_adds_wordings_of_the_same_facts_and_leaves_evaluation_alone() -> None:
    """``train_wide`` (``train-demo --wide-phrasings``): training facts in six wordings; each extra
    wording of a clause states the values every training wording states (numbers, law, roles) and
    shares no three-word run with the held-out wording that training wordings lack; the evaluation
    splits keep their phrasings."""
    import random
    import re

    assert phrasings_of("train_wide") == TRAIN_PHRASINGS + EXTRA_PHRASINGS
    assert phrasings_of("eval") == TRAIN_PHRASINGS and phrasings_of("heldout") == (HELD_OUT_PHRASING,)
    rng = random.Random(7)
    names = {law for law in LAWS} | {role for pair in ROLES for role in pair}
    for _ in range(100):
        facts = draw_facts(rng)
        for clause in CLAUSES.values():
            def stated(text: str) -> set[str]:
                return set(re.findall(r"[\d,]+\d|\bone year\b", text)) | {n for n in names if n in text}

            base = clause(facts, 0)
            # what every training wording says
            values = set.intersection(*(stated(clause(facts, p)) for p in TRAIN_PHRASINGS))
            for p in EXTRA_PHRASINGS:
                text = clause(facts, p)
                assert text != base and all(v in text for v in values), (base, text)
    # and no run of three words of the held-out wording that no training wording has
    def grams(text: str) -> set[tuple[str, ...]]:
        words = re.findall(r"[\w,']+", text.lower())
        return {tuple(words[i : i + 3]) for i in range(len(words) - 2)}

    for _ in range(200):
        facts = draw_facts(rng)
        for clause in CLAUSES.values():
            held = grams(clause(facts, HELD_OUT_PHRASING))
            trained = set().union(*(grams(clause(facts, p)) for p in TRAIN_PHRASINGS))
            for p in EXTRA_PHRASINGS:
                assert not (grams(clause(facts, p)) & held) - trained, clause(facts, p)
    drawn = [draw_facts(rng) for _ in range(200)]
    assert all(in_split(f, "train_wide") == in_split(f, "train") for f in drawn)

    extra = EXTRA_OPENINGS  # openings only the extra wordings use

    def opened(split: str) -> set[str]:
        cases = decision_cases(split, 0, 300)  # type: ignore[arg-type]
        lines = [line.split(". ", 1)[-1] for c in cases for line in c.context.splitlines()]
        return {o for o in extra for line in lines if line.startswith(o)}

    assert opened("train_wide") == set(extra)
    assert opened("train") == opened("eval") == opened("heldout") == set()


@pytest.mark.parametrize("split", ["train", "eval", "heldout"])
def test_every_group_is_answered_consistently_and_within_its_choices(split: str) -> None:
    cases = decision_cases(split, 0, 200)  # type: ignore[arg-type]
    groups = [g for c in cases for g in c.groups]
    assert {g.kind for g in groups} == {"liability", "termination", "renewal", "confidentiality", "law",
                                        "payment", "assignment"}  # fmt: skip
    for group in groups:
        first, second = group.questions
        assert first.answer in first.choices and second.answer in second.choices
        assert not violates(group.rule, first.answer, second.answer), group
    answers = [q.answer for g in groups for q in g.questions]
    assert {YES, NO, NA} <= set(answers)  # every answer kind occurs


def test_violations_follow_each_rule() -> None:
    assert violates("gate", NO, YES) and violates("gate", YES, NA) and not violates("gate", NO, NA)
    assert violates("exclusive", YES, YES) and not violates("exclusive", NO, NO)
    assert violates("implies", YES, NO) and not violates("implies", NO, NO)
    assert violates("opposite", YES, YES) and not violates("opposite", NO, YES)


def test_generation_cases_carry_a_thinking_target_when_thinking() -> None:
    cases = generation_cases("train", 0, 80)
    thinking = [c for c in cases if c.thinking]
    assert thinking and len(thinking) < len(cases)
    assert all(c.target.startswith("<think>\n") and c.target.endswith(c.answer) for c in thinking)
    assert all(c.target == c.answer for c in cases if not c.thinking)


def test_headings_add_a_shared_keyword_and_change_nothing_else() -> None:
    from worker.training.contracts import HEADINGS
    from worker.training.corpus import GROUP_CLAUSES

    for split in ("train", "heldout"):
        plain, headed = decision_cases(split, 2, 30), decision_cases(split, 2, 30, headings=True)  # type: ignore[arg-type]
        for p, h in zip(plain, headed, strict=True):
            assert p.answers == h.answers and [g.kind for g in p.groups] == [g.kind for g in h.groups]
            stripped = [line.split(". ", 1)[0] + ". " + line.split(". ", 2)[-1] if i else line
                        for i, line in enumerate(h.context.splitlines())]  # fmt: skip
            assert stripped == p.context.splitlines()
            for group, question in zip((g for g in h.groups for _ in g.questions), h.questions, strict=True):
                heading = HEADINGS[GROUP_CLAUSES[group.kind]]
                assert question.text.startswith(f"{heading}: ") and f". {heading}. " in h.context
    plain_gen, headed_gen = generation_cases("eval", 2, 10), generation_cases("eval", 2, 10, headings=True)
    assert [c.answer for c in plain_gen] == [c.answer for c in headed_gen]


def test_a_value_question_asks_for_the_clause_value_among_every_value_the_corpus_writes() -> None:
    """``value_case``: the case's own contract (headed too), asked the value of the group the draw
    picks; the answer is among the choices and follows the facts, "none" where the contract has no
    such clause or right; a one-question group breaks no rule."""
    from worker.training.corpus import _facts, decision_case, value_case
    from worker.training.questions import NONE, value_question

    kinds = set()
    for i in range(60):
        for headings in (False, True):
            case = decision_case("train", 0, i, headings=headings)
            for draw, picked in ((0.0, 0), (0.99, -1)):
                value = value_case("train", 0, i, draw, headings)
                assert value == value_case("train", 0, i, draw, headings) and value.context == case.context
                (group,) = value.groups
                (question,) = group.questions
                assert group.rule == "value" and group.kind == case.groups[picked].kind
                assert question.answer in question.choices
                assert len(set(question.choices)) == len(question.choices)
                assert value.answers == (question.answer,)
                assert question.text.startswith("Governing Law: ") == (headings and group.kind == "law")
                kinds.add(group.kind)
    assert len(kinds) == 7
    facts = [_facts("train", 0, i, "decide")[0] for i in range(200)]
    ASSIGNEES = {"free": "anyone", "affiliates": "affiliates", "consent": "no one"}

    def span(n: int | None) -> str:
        return NONE if n is None else ("one year" if n == 1 else f"{n} years")

    expected = {
        "law": lambda f: f.law,
        "payment": lambda f: str(f.payment_days),
        "liability": lambda f: NONE if f.cap is None else f"EUR {f.cap:,}",
        "termination": lambda f: NONE if f.notice_days is None else str(f.notice_days),
        "renewal": lambda f: span(f.renewal_years),
        "confidentiality": lambda f: span(f.survival_years),
        "assignment": lambda f: ASSIGNEES[f.assignment],
    }
    answers: dict[str, set[str]] = {}
    for f in facts:
        for kind, want in expected.items():
            got = value_question(kind, f).questions[0].answer
            assert got == want(f), (kind, f)
            answers.setdefault(kind, set()).add(got)
    assert all(NONE in answers[k] for k in ("liability", "termination", "renewal", "confidentiality"))
    assert answers["assignment"] == {"anyone", "affiliates", "no one"}
    assert not violates("value", YES, NO)
