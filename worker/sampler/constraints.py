"""Restricted slots that must agree (``SlotConstraint``): the choice among allowed combinations.

A constraint lists the combinations of its slots' candidates that may be answered together (a
joint decision's "no cap" goes with "not applicable" for the cap's amount). The engine decides a
slot as before (its candidates scored on the pass that commits it) but, for a constrained slot,
over the combinations still allowed: those agreeing with the slots of the constraint decided
earlier. Slots decided in the same pass (every slot of a ``one_pass`` template) are chosen
together: the combination with the highest summed score. A slot whose last block is in this pass
but which is not committed yet is scored too and counts (the pick maximises over its candidates);
a slot whose last block comes later does not count (its scores so far cover part of it). Afterwards
the undecided slots keep only the candidates some remaining combination holds, so a later pass
can only pick an allowed one. Per-slot scores are summed log-probabilities (each slot's
normalisation is a constant over the combinations, so it does not move the choice).

Pure Python over small lists: a constraint holds a few slots and at most a few hundred
combinations (the API bounds both).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def agreeing(allowed: Sequence[tuple[int, ...]], decided: Mapping[int, int]) -> list[tuple[int, ...]]:
    """The combinations of ``allowed`` that hold ``decided`` (member position -> candidate)."""
    return [combo for combo in allowed if all(combo[p] == c for p, c in decided.items())]


def choose_combination(
    combos: Sequence[tuple[int, ...]], scores: Mapping[int, Mapping[int, float]], u: float | None = None,
    temperature: float = 0.0,
) -> dict[int, tuple[int, float]]:
    """Member position -> (chosen candidate, its probability), for the scored members of ``combos``.

    ``scores``: member position -> candidate -> summed log-probability, for the members decided
    (or scored) in this pass. The combinations are first reduced to those members' part (several
    combinations differing only in unscored members are one choice here, so a value is not
    favoured for appearing in more of them); temperature 0 takes the best total (ties to the
    earlier one), otherwise ``u`` (uniform in [0, 1)) draws from softmax(total / temperature). A
    member's probability is its candidate's share of softmax(total) over the reduced choices (a
    proper distribution over the allowed answers, so never below 1 / the candidates left)."""
    if not combos:
        raise ValueError("no allowed combination agrees with the slots already decided")
    members = sorted(scores)
    choices = list(dict.fromkeys(tuple(combo[p] for p in members) for combo in combos))  # first-seen order
    totals = [
        sum(scores[p].get(c, -math.inf) for p, c in zip(members, choice, strict=True)) for choice in choices
    ]
    top = max(totals)
    if top == -math.inf:  # no choice scored: every one is as likely
        totals, top = [0.0] * len(choices), 0.0
    weights = [math.exp(t - top) for t in totals]
    pick = max(range(len(choices)), key=lambda k: (totals[k], -k))
    if temperature > 0 and u is not None:
        drawn = [math.exp((t - top) / temperature) for t in totals]
        target, at = u * sum(drawn), 0.0
        for k, w in enumerate(drawn):
            at += w
            if target < at:
                pick = k
                break
    whole = sum(weights)
    return {
        p: (c, sum(w for choice, w in zip(choices, weights, strict=True) if choice[k] == c) / whole)
        for k, (p, c) in enumerate(zip(members, choices[pick], strict=True))
    }


def candidates_left(combos: Sequence[tuple[int, ...]], member: int, candidates: Sequence[int]) -> list[int]:
    """``candidates`` of ``member`` that some combination of ``combos`` still holds (in order)."""
    held = {combo[member] for combo in combos}
    return [c for c in candidates if c in held]
