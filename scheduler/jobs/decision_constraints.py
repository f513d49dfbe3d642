"""The rules a decision's declared ``constraints`` must follow, in one place.

The API checks a request with them (``api.schemas.decisions``: 422 with the message) and the
worker checks a stored input again before planning (``worker.decisions.spec``), so both sides
refuse the same inputs with the same words. Pure logic over plain values; the size bounds
(questions per constraint, combinations, constraints) are the API schema's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Constraint = tuple[Sequence[str], Sequence[Sequence[str]]]  # (question ids, allowed combinations)


def constraint_problem(
    mode: str, choices: Mapping[str, Sequence[str]], constraints: Sequence[Constraint]
) -> str | None:
    """Why ``constraints`` (each: question ids, allowed combinations) do not fit a decision of
    ``mode`` whose questions have ``choices`` (id -> choices), or None when they do."""
    if constraints and mode != "joint":
        return 'constraints need mode "joint": independent questions never see each other'
    tied: set[str] = set()
    for questions, allowed in constraints:
        name = list(questions)
        if len(questions) < 2 or not allowed:
            return f"constraint {name}: needs two questions or more and an allowed combination"
        if len(set(questions)) != len(questions):
            return f"constraint {name}: question ids must be distinct"
        if any(len(combo) != len(questions) for combo in allowed):
            return f"constraint {name}: each combination needs one choice per question"
        if len({tuple(combo) for combo in allowed}) != len(allowed):
            return f"constraint {name}: allowed combinations must be distinct"
        for q in questions:
            if q not in choices:
                return f"constraint {name}: no question {q!r}"
            if q in tied:
                return f"question {q!r} is in two constraints (merge them into one)"
            tied.add(q)
        for combo in allowed:
            for q, answer in zip(questions, combo, strict=True):
                if answer not in choices[q]:
                    return f"constraint {name}: {answer!r} is not a choice of {q!r}"
    return None
