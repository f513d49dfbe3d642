"""Scoring the demo's answers against the corpus's truth (pure logic: no jobs, no HTTP).

``cloverq model eval`` submits the cases as real jobs and feeds the results here. A decision
case is scored per question (accuracy), per group (all its questions right) and for consistency
(a group whose answers break its rule, ``worker.training.questions.violates``, whatever the
truth). A generation case is right when its one line equals the expected one (whitespace
trimmed); the tokens per pass are the job's completion tokens over its denoising passes. An
extraction case is scored per field (the value equals the truth, ``null`` included) and per case
(every field right), and its value is judged against the case's schema by ``jsonschema``, an
implementation independent of the canvas that built it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import jsonschema

from worker.training.corpus import DecisionCase, GenerationCase
from worker.training.extraction import ExtractionCase
from worker.training.questions import violates


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
            ok = given == truth and type(given) is type(truth)  # 1 is not True, 0 is not None
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


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None
