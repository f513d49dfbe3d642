"""Scoring the demo's answers against the corpus's truth (pure logic: no jobs, no HTTP).

``cloverq model eval`` submits the cases as real jobs and feeds the results here. A decision
case is scored per question (accuracy), per group (all its questions right) and for consistency
(a group whose answers break its rule, ``worker.training.questions.violates``, whatever the
truth). A generation case is right when its one line equals the expected one (whitespace
trimmed); the tokens per pass are the job's completion tokens over its denoising passes. An
extraction case is scored per field (the value equals the truth, ``null`` included) and per case
(every field right), and its value is judged against the case's schema by ``jsonschema``, an
implementation independent of the canvas that built it. A tool-call case is right when the answer
makes exactly the expected call (the function, and arguments equal to the truth, types included)
or, for a question, makes no call and its one line equals the expected one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from worker.training.corpus import DecisionCase, GenerationCase
from worker.training.extraction import ExtractionCase
from worker.training.questions import violates
from worker.training.tool_calls import ToolCallCase, call_parts


@dataclass
class DecisionTally:
    jobs: int = 0
    failed_jobs: int = 0  # jobs that ended without answers (their questions count as wrong)
    questions: int = 0
    correct: int = 0
    groups: int = 0
    groups_all_correct: int = 0
    violations: int = 0
    invalid_output_retries: int = 0
    per_kind: dict[str, list[int]] = field(default_factory=dict)  # group kind -> [correct, questions]
    # "4q/3" (the third answer of a four-question case) -> [correct, asked]: where a mode loses
    per_slot: dict[str, list[int]] = field(default_factory=dict)

    def add(self, case: DecisionCase, answers: Sequence[str] | None, retries: int = 0) -> None:
        """Score one job's answers (``None``: the job failed) to ``case``, in question order."""
        self.jobs += 1
        self.invalid_output_retries += retries
        if answers is None:
            self.failed_jobs += 1
        offset = 0
        for group in case.groups:
            truth = [q.answer for q in group.questions]
            given = (
                list(answers[offset : offset + len(truth)]) if answers is not None else [None] * len(truth)
            )
            offset += len(truth)
            right = sum(g == t for g, t in zip(given, truth, strict=True))
            self.questions += len(truth)
            self.correct += right
            self.groups += 1
            self.groups_all_correct += right == len(truth)
            tied = len(given) == 2  # a value question (one question) has no rule to break
            if answers is not None and tied and violates(group.rule, str(given[0]), str(given[1])):
                self.violations += 1
            kind = self.per_kind.setdefault(group.kind, [0, 0])
            kind[0] += right
            kind[1] += len(truth)
        for position, expected in enumerate(case.answers, 1):
            slot = self.per_slot.setdefault(f"{len(case.answers)}q/{position}", [0, 0])
            slot[0] += answers is not None and answers[position - 1] == expected
            slot[1] += 1

    def as_dict(self) -> dict[str, object]:
        return {
            "jobs": self.jobs,
            "failed_jobs": self.failed_jobs,
            "questions": self.questions,
            "accuracy": _share(self.correct, self.questions),
            "groups": self.groups,
            "group_all_correct": _share(self.groups_all_correct, self.groups),
            "consistency_violations": self.violations,
            "invalid_output_retries": self.invalid_output_retries,
            "accuracy_by_kind": {k: _share(c, n) for k, (c, n) in sorted(self.per_kind.items())},
            "correct_of_asked_by_slot": {k: list(v) for k, v in sorted(self.per_slot.items())},
        }


@dataclass
class GenerationTally:
    jobs: int = 0
    failed_jobs: int = 0
    exact: int = 0
    tokens: int = 0
    passes: int = 0

    def add(self, case: GenerationCase, text: str | None, tokens: int, passes: int) -> None:
        self.jobs += 1
        if text is None:
            self.failed_jobs += 1
            return
        self.exact += text.strip() == case.answer
        self.tokens += tokens
        self.passes += passes

    def as_dict(self) -> dict[str, object]:
        return {
            "jobs": self.jobs,
            "failed_jobs": self.failed_jobs,
            "score": _share(self.exact, self.jobs),
            "tokens_per_pass": round(self.tokens / self.passes, 3) if self.passes else None,
            "tokens": self.tokens,
            "passes": self.passes,
        }


@dataclass
class ExtractionTally:
    jobs: int = 0
    failed_jobs: int = 0  # jobs that ended without a value (their fields count as wrong)
    schema_valid: int = 0
    fields: int = 0
    correct: int = 0
    all_correct: int = 0
    invalid_output_retries: int = 0
    per_field: dict[str, list[int]] = field(default_factory=dict)  # field name -> [correct, asked]

    def add(self, case: ExtractionCase, value: object | None, retries: int = 0) -> None:
        """Score one job's value (``None``: the job failed) for ``case``."""
        self.jobs += 1
        self.invalid_output_retries += retries
        if value is None:
            self.failed_jobs += 1
        else:
            self.schema_valid += jsonschema.Draft202012Validator(case.schema).is_valid(value)
        right = 0
        for name, truth in case.answer.items():
            given = value.get(name, _MISSING) if isinstance(value, dict) else _MISSING
            ok = _same_value(given, truth)
            right += ok
            tally = self.per_field.setdefault(name, [0, 0])
            tally[0] += ok
            tally[1] += 1
        self.fields += len(case.answer)
        self.correct += right
        self.all_correct += right == len(case.answer)

    def as_dict(self) -> dict[str, object]:
        return {
            "jobs": self.jobs,
            "failed_jobs": self.failed_jobs,
            "schema_valid": _share(self.schema_valid, self.jobs - self.failed_jobs),
            "fields": self.fields,
            "field_accuracy": _share(self.correct, self.fields),
            "all_fields_correct": _share(self.all_correct, self.jobs),
            "invalid_output_retries": self.invalid_output_retries,
            "accuracy_by_field": {k: _share(c, n) for k, (c, n) in sorted(self.per_field.items())},
        }


_MISSING = object()


@dataclass
class ToolCallTally:
    jobs: int = 0
    failed_jobs: int = 0  # jobs that ended without an answer (counted wrong)
    call_cases: int = 0  # cases whose request calls for a tool
    right_function: int = 0  # ... answered by exactly one call of the right function
    right_call: int = 0  # ... and its arguments right too
    question_cases: int = 0  # cases to answer in text
    no_call: int = 0  # ... answered without a call
    right_answer: int = 0  # ... and with the expected line
    # answers that opened a call the parser could not read (returned as text), after the one retry
    # a ``tool_choice`` ``auto`` job makes (``worker/tool_job.py``)
    malformed: int = 0
    invalid_output_retries: int = 0  # decodes an auto job made again after a malformed call
    per_function: dict[str, list[int]] = field(default_factory=dict)  # name -> [right calls, asked]

    def add(self, case: ToolCallCase, text: str | None, calls: Sequence[Mapping[str, Any]] | None,
            retries: int = 0) -> None:  # fmt: skip
        """Score one job's answer (``text``, ``calls`` in OpenAI's shape; ``text`` None: it failed)."""
        self.jobs += 1
        self.invalid_output_retries += retries
        if text is None:
            self.failed_jobs += 1
        made = [call_parts(c) for c in calls or ()]
        broken = not made and text is not None and "<tool_call>" in text
        self.malformed += broken
        if case.call is None:
            self.question_cases += 1
            quiet = text is not None and not made and not broken  # an unreadable call is a call
            self.no_call += quiet
            self.right_answer += quiet and (text or "").strip() == case.answer
            return
        self.call_cases += 1
        name, arguments = case.call
        function_ok = len(made) == 1 and made[0][0] == name
        call_ok = function_ok and _same(made[0][1], arguments)
        self.right_function += function_ok
        self.right_call += call_ok
        tally = self.per_function.setdefault(name, [0, 0])
        tally[0] += call_ok
        tally[1] += 1

    def as_dict(self) -> dict[str, object]:
        return {
            "jobs": self.jobs,
            "failed_jobs": self.failed_jobs,
            "accuracy": _share(self.right_call + self.right_answer, self.jobs),
            "call_cases": self.call_cases,
            "right_function": _share(self.right_function, self.call_cases),
            "right_call": _share(self.right_call, self.call_cases),
            "question_cases": self.question_cases,
            "no_call_when_none_needed": _share(self.no_call, self.question_cases),
            "right_answer": _share(self.right_answer, self.question_cases),
            "malformed_calls": self.malformed,
            "invalid_output_retries": self.invalid_output_retries,
            "right_call_by_function": {k: _share(c, n) for k, (c, n) in sorted(self.per_function.items())},
        }


def _same(given: Any, truth: Mapping[str, Any]) -> bool:
    """Arguments equal to the truth, value and type (``30`` is not ``"30"``)."""
    return (isinstance(given, dict) and given.keys() == truth.keys()
            and all(_same_value(given[k], v) for k, v in truth.items()))


def _same_value(given: Any, truth: Any) -> bool:
    """Equal and of the same type: ``1`` is not ``True``, ``0`` is not ``None``, ``30`` not ``"30"``."""
    return bool(given == truth) and type(given) is type(truth)


def retries(usage: Mapping[str, Any] | None) -> int:
    """Invalid-output retries of a job, from its result's ``usage.attempts`` (absent: one decode)."""
    return int((usage or {}).get("attempts", 1)) - 1


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None
