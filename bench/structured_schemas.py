"""Seeded random JSON Schemas over the whole supported subset (the property test and the bench).

Every supported keyword appears: type (all seven), enum, const, anyOf, type lists, properties,
required, additionalProperties, items, minItems, maxItems, minLength, maxLength, format date,
minimum, maximum, exclusiveMinimum, exclusiveMaximum, and annotations. Nesting up to ``depth``.
"""

from __future__ import annotations

import random
from typing import Any

_WORDS = ("name", "date", "amount", "party", "notice", "tags", "kind", "id", "note", "ok")


def _scalar(rng: random.Random) -> dict[str, Any]:
    pick = rng.randrange(11)
    if pick == 0:
        s: dict[str, Any] = {"type": "string"}
        if rng.random() < 0.6:
            s["maxLength"] = rng.randint(0, 8)
        if rng.random() < 0.4:
            s["minLength"] = rng.randint(0, min(3, s.get("maxLength", 3)))
        return s
    if pick == 1:
        return {"type": "string", "format": "date"}
    if pick == 2:
        s = {"type": "integer"}
        if rng.random() < 0.6:
            s["minimum"] = rng.randint(-50, 50)
        if rng.random() < 0.6:
            s["maximum"] = s.get("minimum", -50) + rng.choice([0, 3, 40, 500, 100000])
        if "minimum" in s and rng.random() < 0.3:
            s["exclusiveMinimum"] = s["minimum"] - 1
        return s
    if pick == 3:
        s = {"type": "number"}
        if rng.random() < 0.5:
            s["minimum"] = rng.choice([-10.5, 0, 2.25, 100])
        if rng.random() < 0.5:
            s["exclusiveMaximum"] = s.get("minimum", 0) + rng.choice([0.5, 1, 7, 1000])
        return s
    if pick == 4:
        return {"type": "boolean"}
    if pick == 5:
        return {"type": "null"}
    if pick == 6:
        return {"enum": rng.sample(["red", "green", "blue", 3, None, True, "a b"], rng.randint(1, 4))}
    if pick == 7:
        return {"const": rng.choice(["fixed", 7, False])}
    if pick == 8:
        return {"type": ["string", "null"], "maxLength": rng.randint(1, 5)}
    if pick == 9:
        return {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}
    return {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "integer", "maximum": 99}]}


def random_schema(rng: random.Random, depth: int = 4) -> dict[str, Any]:
    """A random schema nesting at most ``depth`` levels of objects/arrays."""
    if depth <= 0 or rng.random() < 0.35:
        s = _scalar(rng)
    elif rng.random() < 0.6:
        names = rng.sample(_WORDS, rng.randint(0, 3))
        s = {
            "type": "object",
            "properties": {n: random_schema(rng, depth - 1) for n in names},
            "required": [n for n in names if rng.random() < 0.6],
        }
        if rng.random() < 0.5:
            s["additionalProperties"] = False
    else:
        s = {"type": "array", "items": random_schema(rng, depth - 1)}
        if rng.random() < 0.5:
            s["minItems"] = rng.randint(0, 1)
        if rng.random() < 0.5:
            s["maxItems"] = rng.randint(s.get("minItems", 0), 2)
    if rng.random() < 0.1:
        s["description"] = "a field"
    return s


def schema_batch(seed: int, count: int, depth: int = 4) -> list[dict[str, Any]]:
    """``count`` schemas from ``seed`` whose roots are objects (as response formats are)."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    while len(out) < count:
        s = random_schema(rng, depth)
        if s.get("type") != "object":
            s = {"type": "object", "properties": {"value": s}, "required": ["value"]}
        out.append(s)
    return out
