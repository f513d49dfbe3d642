"""Request models of ``kind: "decide"`` jobs (the union member lives in ``api.schemas.jobs``).

Static shape rules are here; limits that depend on the deployment (question count, context
size, budget) are checked in :mod:`api.decision_limits`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, StringConstraints, model_validator

from api.schemas.common import (
    MAX_STEP_BUDGET_BOUND,
    StrictModel,
    Text,
    storable_text,
)
from api.schemas.decoding import DecodingParams
from scheduler.jobs.decision_constraints import constraint_problem

MAX_ID_CHARS = 64
MAX_CHOICE_CHARS = 64
MAX_QUESTION_CHARS = 4000
MAX_DECIDE_SEED = 2**62  # the worker derives per-question seeds from it

QuestionId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS),
                      AfterValidator(storable_text)]
Choice = Annotated[str, StringConstraints(min_length=1, max_length=MAX_CHOICE_CHARS),
                   AfterValidator(storable_text)]
QuestionText = Annotated[str, StringConstraints(min_length=1, max_length=MAX_QUESTION_CHARS),
                         AfterValidator(storable_text)]


class DecisionQuestionIn(StrictModel):
    """One question; the answer is always exactly one of ``choices``."""

    id: QuestionId
    text: QuestionText
    choices: Annotated[list[Choice], Field(min_length=2)] = Field(default_factory=lambda: ["yes", "no"])

    @model_validator(mode="after")
    def _distinct_choices(self) -> DecisionQuestionIn:
        if len(set(self.choices)) != len(self.choices):
            raise ValueError(f"question {self.id!r}: choices must be distinct")
        return self


MAX_CONSTRAINT_QUESTIONS = 8
MAX_CONSTRAINT_COMBINATIONS = 256


class DecisionConstraintIn(StrictModel):
    """Answers that must agree: the answers to ``questions`` are always one of ``allowed``."""

    questions: list[QuestionId] = Field(
        min_length=2, max_length=MAX_CONSTRAINT_QUESTIONS,
        description="Ids of the questions tied (two or more; a question is in at most one constraint).",
    )
    allowed: list[list[Choice]] = Field(
        min_length=1, max_length=MAX_CONSTRAINT_COMBINATIONS,
        description="The combinations that may be answered, one choice per question in that order.",
    )


class DecideInput(StrictModel):
    """A document and the questions to judge against it."""

    context: Text
    questions: Annotated[list[DecisionQuestionIn], Field(min_length=1)]
    mode: Literal["independent", "joint"] = Field(
        "independent",
        description="independent: one sequence per question (batched); joint: all answered together.",
    )
    rationale: bool = Field(False, description="Add a short free-text rationale to every answer.")
    constraints: list[DecisionConstraintIn] | None = Field(
        None, max_length=64,
        description="Joint mode: answers that must agree (the answers are always an allowed combination).",
    )

    @model_validator(mode="after")
    def _distinct_ids(self) -> DecideInput:
        ids = [q.id for q in self.questions]
        if len(set(ids)) != len(ids):
            raise ValueError("question ids must be distinct")
        return self

    @model_validator(mode="after")
    def _constraints_fit(self) -> DecideInput:
        choices = {q.id: q.choices for q in self.questions}
        constraints = [(c.questions, c.allowed) for c in self.constraints or ()]
        problem = constraint_problem(self.mode, choices, constraints)
        if problem is not None:
            raise ValueError(problem)
        return self

    def text_parts(self) -> list[str]:
        """Every piece of user-supplied text (for the prompt-size limit)."""
        return [self.context, *(q.text for q in self.questions)]


class DecideParams(DecodingParams):
    """A decision's decoding parameters: the shared ones, with a smaller seed range (the worker
    derives per-question seeds from it) and a step budget per sequence."""

    seed: int | None = Field(None, ge=0, le=MAX_DECIDE_SEED)
    step_budget: int | None = Field(None, ge=1, le=MAX_STEP_BUDGET_BOUND,
                                    description="Max denoising passes per sequence.")
