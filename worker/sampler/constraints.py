"""Restricted slots that must agree (``SlotConstraint``): the choice among allowed combinations.

A constraint lists the combinations of its slots' candidates that may be answered together (a
joint decision's "no cap" goes with "not applicable" for the cap's amount). The engine decides a
slot as before (its candidates scored on the pass that commits it) but, for a constrained slot,
over the combinations still allowed: those agreeing with the slots of the constraint decided
earlier. Slots decided in the same pass (every slot of a ``one_pass`` template) are chosen
together: the combination with the highest summed score. A slot scored in this pass but not
committed counts with its best allowed candidate; a slot not scored yet counts zero. Afterwards
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
) -> tuple[tuple[int, ...], list[float]]:
    """(the chosen combination, each member's probability of its candidate) among ``combos``.

    ``scores``: member position -> candidate -> summed log-probability (members without scores
    count zero). Temperature 0 takes the best total (ties to the earlier combination); otherwise
    ``u`` (uniform in [0, 1)) draws from softmax(total / temperature). A member's probability is
    its candidate's share of softmax(total) over ``combos`` (a proper distribution over the
    allowed answers, so never below 1 / the candidates left)."""
    if not combos:
        raise ValueError("no allowed combination agrees with the slots already decided")
    totals = [
        sum(scores[p].get(c, -math.inf) for p, c in enumerate(combo) if p in scores) for combo in combos
    ]
    top = max(totals)
    if top == -math.inf:  # no combination scored: every one is as likely
        totals, top = [0.0] * len(combos), 0.0
    weights = [math.exp(t - top) for t in totals]
    if temperature > 0 and u is not None:
        drawn = [math.exp((t - top) / temperature) for t in totals]
        target, at = u * sum(drawn), 0.0
        pick = len(combos) - 1
        for k, w in enumerate(drawn):
            at += w
            if target < at:
                pick = k
                break
    else:
        pick = max(range(len(combos)), key=lambda k: (totals[k], -k))
    chosen = combos[pick]
    whole = sum(weights)
    probs = [sum(w for combo, w in zip(combos, weights, strict=True) if combo[p] == c) / whole
             for p, c in enumerate(chosen)]  # fmt: skip
    return chosen, probs


def candidates_left(combos: Sequence[tuple[int, ...]], member: int, candidates: Sequence[int]) -> list[int]:
    """``candidates`` of ``member`` that some combination of ``combos`` still holds (in order)."""
    held = {combo[member] for combo in combos}
    return [c for c in candidates if c in held]
