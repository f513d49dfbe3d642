"""What a decision job asks: a context, questions with choices, a mode.

The API validates the request body with pydantic; this is the worker-side, framework-free
view of the same input (built from the job row's JSON), so the decision code never depends on
the API's schema classes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from scheduler.jobs.decision_constraints import constraint_problem

DEFAULT_CHOICES: tuple[str, ...] = ("yes", "no")

DecisionMode = Literal["independent", "joint"]


class DecisionTokenizer(Protocol):
    """The part of ``worker.model.tokenizer.Tokenizer`` the decision service uses."""

    pad_token_id: int | None
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def render_chat(
        self, messages: list[dict[str, str]], *, enable_thinking: bool, add_generation_prompt: bool = ...
    ) -> str: ...

    def __hash__(self) -> int: ...  # per-tokenizer caches key on it (``templates.safe_text_token_ids``)


@dataclass(frozen=True)
class DecisionQuestion:
    """One question; ``choices`` are the only answers the model may give."""

    id: str
    text: str
    choices: tuple[str, ...] = DEFAULT_CHOICES


@dataclass(frozen=True)
class DecisionConstraint:
    """Answers to ``questions`` (ids) must be one of the ``allowed`` combinations (one choice per
    question, in that order); joint mode enforces it (``worker/sampler/constraints.py``)."""

    questions: tuple[str, ...]
    allowed: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class DecisionSpec:
    """A whole decision job: every question is judged against ``context``."""

    context: str
    questions: tuple[DecisionQuestion, ...]
    mode: DecisionMode = "independent"
    rationale: bool = False
    constraints: tuple[DecisionConstraint, ...] = ()

    @classmethod
    def from_input(cls, data: Mapping[str, Any]) -> DecisionSpec:
        """Build from a job's stored ``input`` JSON (already validated by the API)."""
        questions = tuple(
            DecisionQuestion(
                id=str(q["id"]),
                text=str(q["text"]),
                choices=tuple(str(c) for c in (q.get("choices") or DEFAULT_CHOICES)),
            )
            for q in data["questions"]
        )
        mode = data.get("mode", "independent")
        if mode not in ("independent", "joint"):
            raise ValueError(f"unknown decision mode {mode!r}")
        if not questions:
            raise ValueError("a decision needs at least one question")
        try:
            constraints = tuple(
                DecisionConstraint(tuple(str(q) for q in c["questions"]),
                                   tuple(tuple(str(a) for a in combo) for combo in c["allowed"]))
                for c in data.get("constraints") or ()
            )  # fmt: skip
        except (KeyError, TypeError) as exc:
            raise ValueError(f"a constraint needs questions and allowed combinations: {exc}") from exc
        choices = {q.id: q.choices for q in questions}
        problem = constraint_problem(mode, choices, [(c.questions, c.allowed) for c in constraints])
        if problem is not None:  # the API's own rules (a stored input that bypassed it)
            raise ValueError(problem)
        return cls(
            context=str(data.get("context", "")),
            questions=questions,
            mode=mode,
            rationale=bool(data.get("rationale", False)),
            constraints=constraints,
        )
