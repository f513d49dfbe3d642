"""The demo corpus: decision and generation cases over synthetic contracts, split by seed and facts.

Three splits, disjoint by construction, and a wider training split:

- ``train``: contracts whose facts' digest is not ``0 mod FACT_BUCKETS``, clause phrasings
  ``TRAIN_PHRASINGS``;
- ``eval``: contracts whose facts' digest IS ``0 mod FACT_BUCKETS`` (no evaluation contract has
  the facts of any training contract, whatever the seeds), the training phrasings;
- ``heldout``: the evaluation facts written only in ``HELD_OUT_PHRASING``, a wording of every
  clause that training never shows;
- ``train_wide``: training facts (another draw) in ``TRAIN_PHRASINGS`` and ``EXTRA_PHRASINGS``,
  a training split with more wordings of each fact (``train-demo --wide-phrasings``).

Each case is drawn from its own ``random.Random(f"{split}/{seed}/{index}")`` (string seeds hash
deterministically), so a case depends only on (split, seed, index).

A ``DecisionCase`` is one contract and one or two ``QuestionGroup``s, asked as a ``decide`` job
asks them (``spec(mode)``); a ``GenerationCase`` is a chat whose target is a one-line answer or
a one-line clause summary, with thinking off or on (then the target starts with the reasoning in
a think block, as a thinking model writes it); an ``ExtractionCase`` is a contract and a schema of
some of its facts (``worker.training.extraction``), asked as an ``extract`` job asks; a
``ToolCallCase`` is a contract, a request and the tool call it calls for, or a question to answer
in text with the same tools on offer (``worker.training.tool_calls``).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Literal

from worker.decisions.spec import DecisionMode, DecisionQuestion, DecisionSpec
from worker.training.contracts import (
    EXTRA_PHRASINGS,
    HEADINGS,
    HELD_OUT_PHRASING,
    TRAIN_PHRASINGS,
    ContractFacts,
    draw_facts,
    money,
    render_contract,
    years,
)
from worker.training.extraction import FIELDS as EXTRACT_FIELDS
from worker.training.extraction import ExtractionCase, clauses_of, draw_kinds, field_value
from worker.training.questions import GROUPS, QuestionGroup, draw_groups, value_question, violates
from worker.training.tool_calls import NO_CALL_SHARE, ToolCallCase, draw_call

GROUP_CLAUSES = {  # the clause a question group is about
    "liability": "liability", "termination": "termination", "renewal": "term", "confidentiality":
    "confidentiality", "law": "law", "payment": "payment", "assignment": "assignment",
}  # fmt: skip

# ``train_wide``: the training facts written in more phrasings (``contracts.EXTRA_PHRASINGS`` too),
# a training split only (``train-demo --wide-phrasings``); the evaluation splits stay as they are
Split = Literal["train", "eval", "heldout", "train_wide"]
SPLITS: tuple[str, ...] = ("train", "eval", "heldout")
FACT_BUCKETS = 8  # one bucket of the fact space is evaluation-only
GenerationTask = Literal["answer", "summary"]


def in_split(facts: ContractFacts, split: Split) -> bool:
    evaluation = facts.digest() % FACT_BUCKETS == 0
    return not evaluation if split in ("train", "train_wide") else evaluation


def phrasings_of(split: Split) -> tuple[int, ...]:
    if split == "train_wide":
        return TRAIN_PHRASINGS + EXTRA_PHRASINGS
    return (HELD_OUT_PHRASING,) if split == "heldout" else TRAIN_PHRASINGS


def _facts(split: Split, seed: int, index: int, kind: str) -> tuple[ContractFacts, random.Random]:
    rng = random.Random(f"{split}/{seed}/{kind}/{index}")
    facts = draw_facts(rng)
    while not in_split(facts, split):
        facts = draw_facts(rng)
    return facts, rng


@dataclass(frozen=True)
class DecisionCase:
    context: str
    groups: tuple[QuestionGroup, ...]

    @property
    def questions(self) -> tuple[DecisionQuestion, ...]:
        flat = [q for g in self.groups for q in g.questions]
        return tuple(
            DecisionQuestion(id=f"q{i}", text=q.text, choices=q.choices) for i, q in enumerate(flat, 1)
        )

    @property
    def answers(self) -> tuple[str, ...]:
        return tuple(q.answer for g in self.groups for q in g.questions)

    def spec(self, mode: DecisionMode) -> DecisionSpec:
        return DecisionSpec(context=self.context, questions=self.questions, mode=mode)

    def job_input(self, mode: DecisionMode, constraints: bool = False) -> dict[str, object]:
        """The body's ``input`` of a ``decide`` job asking this case; ``constraints`` (joint mode):
        each tied group's rule declared as the combinations it allows."""
        body: dict[str, object] = {
            "context": self.context,
            "mode": mode,
            "questions": [{"id": q.id, "text": q.text, "choices": list(q.choices)} for q in self.questions],
        }
        if constraints and mode == "joint":
            body["constraints"] = self.constraints()
        return body

    def constraints(self) -> list[dict[str, object]]:
        """Each two-question group's rule as a decision constraint (the pairs it does not break)."""
        out: list[dict[str, object]] = []
        at = 1
        for group in self.groups:
            ids = [f"q{at + k}" for k in range(len(group.questions))]
            at += len(ids)
            if len(ids) != 2 or group.rule == "value":
                continue
            first, second = group.questions
            allowed = [[a, b] for a in first.choices for b in second.choices
                       if not violates(group.rule, a, b)]  # fmt: skip
            out.append({"questions": ids, "allowed": allowed})
        return out


def headed(group: QuestionGroup) -> QuestionGroup:
    """``group`` with each question opening with its clause's heading ("Termination: May ...")."""
    heading = HEADINGS[GROUP_CLAUSES[group.kind]]
    return dataclasses.replace(
        group, questions=tuple(dataclasses.replace(q, text=f"{heading}: {q.text}") for q in group.questions)
    )


def decision_case(
    split: Split, seed: int, index: int, groups: int | None = None, headings: bool = False
) -> DecisionCase:
    """Case ``index`` of ``split``: one or two question groups (the evaluation suites' and the
    tokenizer corpus's draw), or ``groups`` of them (training rows that ask more per contract).
    ``headings``: clauses carry section headings and questions repeat their clause's heading (the
    same draws, facts and answers; the phrasings of clause bodies stay split)."""
    return _decision_case_and_facts(split, seed, index, groups, headings)[0]


def _decision_case_and_facts(
    split: Split, seed: int, index: int, groups: int | None, headings: bool
) -> tuple[DecisionCase, ContractFacts]:
    facts, rng = _facts(split, seed, index, "decide")
    drawn = tuple(draw_groups(facts, rng, rng.choice((1, 2)) if groups is None else groups))
    required = tuple(GROUP_CLAUSES[g.kind] for g in drawn)
    text = render_contract(facts, rng, phrasings_of(split), required, headings)
    return DecisionCase(context=text, groups=tuple(headed(g) for g in drawn) if headings else drawn), facts


def value_case(split: Split, seed: int, index: int, kind_draw: float, headings: bool = False) -> DecisionCase:
    """Decision case ``index``'s contract asked the value question (``questions.value_question``)
    of one of its groups' kinds, the ``kind_draw`` (in [0, 1)) share along them: a retrieval row
    for training (``TrainConfig.value_share``)."""
    case, facts = _decision_case_and_facts(split, seed, index, None, headings)
    group = case.groups[int(kind_draw * len(case.groups))]
    value = value_question(group.kind, facts)
    return DecisionCase(context=case.context, groups=(headed(value) if headings else value,))


def focus_case(split: Split, seed: int, index: int, kind: str, headings: bool = False) -> DecisionCase:
    """A contract stating ``kind``'s clause, asked ``kind``'s question group, from a stream of its
    own ("focus"): a training row of one chosen kind (``TrainConfig.focus_kind``)."""
    return _focus_case_and_facts(split, seed, index, kind, headings)[0]


def focus_value_case(split: Split, seed: int, index: int, kind: str, headings: bool = False) -> DecisionCase:
    """``focus_case``'s contract asked ``kind``'s value question instead."""
    case, facts = _focus_case_and_facts(split, seed, index, kind, headings)
    value = value_question(kind, facts)
    return DecisionCase(context=case.context, groups=(headed(value) if headings else value,))


def _focus_case_and_facts(
    split: Split, seed: int, index: int, kind: str, headings: bool
) -> tuple[DecisionCase, ContractFacts]:
    facts, rng = _facts(split, seed, index, "focus")
    group = GROUPS[kind](facts, rng)
    text = render_contract(facts, rng, phrasings_of(split), (GROUP_CLAUSES[kind],), headings)
    return DecisionCase(context=text, groups=(headed(group) if headings else group,)), facts


def decision_cases(
    split: Split, seed: int, count: int, start: int = 0, headings: bool = False
) -> list[DecisionCase]:
    return [decision_case(split, seed, i, headings=headings) for i in range(start, start + count)]


def extraction_case(split: Split, seed: int, index: int, headings: bool = False) -> ExtractionCase:
    """Extraction case ``index`` of ``split``: a contract and two or three of its facts as the
    fields of a schema (``worker.training.extraction``), drawn from their own stream ("extract")."""
    facts, rng = _facts(split, seed, index, "extract")
    kinds = draw_kinds(rng)
    text = render_contract(facts, rng, phrasings_of(split), clauses_of(kinds), headings)
    answer = {EXTRACT_FIELDS[k].name: field_value(k, facts) for k in kinds}
    return ExtractionCase(context=text, kinds=kinds, answer=answer)


def extraction_cases(
    split: Split, seed: int, count: int, start: int = 0, headings: bool = False
) -> list[ExtractionCase]:
    return [extraction_case(split, seed, i, headings) for i in range(start, start + count)]


@dataclass(frozen=True)
class GenerationCase:
    task: GenerationTask
    messages: tuple[dict[str, str], ...]
    answer: str  # the expected one line
    reasoning: str  # what a thinking-mode answer reasons first
    thinking: bool

    @property
    def target(self) -> str:
        """The assistant text the model is trained to write after the generation prompt."""
        if self.thinking:  # the prompt of thinking mode carries no think block: the model opens it
            return f"<think>\n{self.reasoning}\n</think>\n\n{self.answer}"
        return self.answer


def _summaries(f: ContractFacts) -> dict[str, tuple[str, str, str]]:
    """Per clause: (question for a one-line answer, its answer, the clause's one-line summary)."""
    (ra, rb), (na, nb) = f.roles, f.names
    renew = f"renews for {years(f.renewal_years)} at a time" if f.renewal_years else "does not renew"
    notice = f"{f.notice_days} days." if f.notice_days else f"The {rb} may not terminate for convenience."
    return {
        "parties": (f"Who is the {ra}?", f"{na}.", f"{na} is the {ra} and {nb} is the {rb}."),
        "term": ("How long is the initial term?", f"{years(f.term_years).capitalize()}.",
                 f"The agreement lasts {years(f.term_years)} and {renew}."),
        "termination": (f"How much notice does the {rb} need to terminate for convenience?", notice,
                        f"The {rb} may terminate for convenience on {f.notice_days} days notice."
                        if f.notice_days else f"The {rb} may not terminate for convenience."),
        "liability": ("What is the liability cap?", f"{money(f.cap)}." if f.cap else "There is no cap.",
                      f"The liability of the {ra} is capped at {money(f.cap)}."
                      if f.cap else f"The liability of the {ra} is unlimited."),
        "law": ("Which law governs the agreement?", f"The laws of {f.law}.",
                f"The laws of {f.law} govern it."),
        "payment": ("When must invoices be paid?", f"Within {f.payment_days} days.",
                    f"The {rb} pays invoices within {f.payment_days} days."),
        "confidentiality": ("How long does confidentiality last after termination?",
                            f"{years(f.survival_years).capitalize()}." if f.survival_years
                            else "There is no confidentiality clause.",
                            f"Confidentiality survives {years(f.survival_years)} after termination."
                            if f.survival_years else "There are no confidentiality duties."),
    }  # fmt: skip


def generation_case(split: Split, seed: int, index: int, headings: bool = False) -> GenerationCase:
    """Generation case ``index`` of ``split`` (``headings``: the contract's clauses headed)."""
    facts, rng = _facts(split, seed, index, "generate")
    clause, (question, answer, summary) = rng.choice(sorted(_summaries(facts).items()))
    required = () if clause == "parties" else (clause,)
    text = render_contract(facts, rng, phrasings_of(split), required, headings)
    task: GenerationTask = rng.choice(("answer", "summary"))
    ask = (
        f"Question: {question}\nAnswer in one line."
        if task == "answer"
        else (f"Summarise the {clause} clause in one line.")
    )
    return GenerationCase(
        task=task,
        messages=({"role": "user", "content": f"Contract:\n{text}\n\n{ask}"},),
        answer=answer if task == "answer" else summary,
        reasoning=f"The {clause} clause: {summary}",
        thinking=rng.random() < 0.25,
    )


def generation_cases(
    split: Split, seed: int, count: int, start: int = 0, headings: bool = False
) -> list[GenerationCase]:
    return [generation_case(split, seed, i, headings) for i in range(start, start + count)]


def tool_call_case(split: Split, seed: int, index: int, headings: bool = False) -> ToolCallCase:
    """Tool-call case ``index`` of ``split`` (``worker.training.tool_calls``), from its own stream."""
    facts, rng = _facts(split, seed, index, "tool")
    if rng.random() < NO_CALL_SHARE:
        clause, (question, answer, _summary) = rng.choice(sorted(_summaries(facts).items()))
        required = () if clause == "parties" else (clause,)
        text = render_contract(facts, rng, phrasings_of(split), required, headings)
        content = f"Contract:\n{text}\n\nQuestion: {question}\nAnswer in one line."
        return ToolCallCase(messages=({"role": "user", "content": content},), call=None, answer=answer)
    name, arguments, request, needs = draw_call(facts, rng)
    text = render_contract(facts, rng, phrasings_of(split), (needs,) if needs else (), headings)
    content = f"Contract:\n{text}\n\n{request}"
    return ToolCallCase(messages=({"role": "user", "content": content},), call=(name, arguments), answer="")


def tool_call_cases(
    split: Split, seed: int, count: int, start: int = 0, headings: bool = False
) -> list[ToolCallCase]:
    return [tool_call_case(split, seed, i, headings) for i in range(start, start + count)]
