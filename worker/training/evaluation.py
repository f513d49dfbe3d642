"""Scoring the demo's answers against the corpus's truth (pure logic: no jobs, no HTTP).

``cloverq model eval`` submits the cases as real jobs and feeds the results here. A decision
case is scored per question (accuracy), per group (all its questions right) and for consistency
(a group whose answers break its rule, ``worker.training.questions.violates``, whatever the
truth). A generation case is right when its one line equals the expected one (whitespace
trimmed); the tokens per pass are the job's completion tokens over its denoising passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from worker.training.corpus import DecisionCase, GenerationCase
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


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None
