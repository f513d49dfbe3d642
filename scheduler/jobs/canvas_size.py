"""How many positions a schema's output canvas takes, estimated without a tokenizer.

The worker lays a schema out as a canvas (``worker/structured/canvas.py``) and decodes exactly
that many positions, whatever ``max_new_tokens`` says; the API and the router have no tokenizer,
yet the router's cost (``scheduler/jobs/routing.py``) needs the generated length. This walks the
parsed schema with the canvas's own room rules and counts fixed text (braces, keys, enum values)
in characters: an upper bound for tokenizers whose tokens cover at least one character each, as
byte-level BPE tokens of ASCII text do. Slots that grow (strings, digits) count their capacity in
tokens, as the canvas does.

The canvas's room defaults are defined here, and ``worker.structured.canvas.CanvasOptions`` takes
its defaults from these constants (the scheduler may not import the worker, the worker may import
the scheduler); ``tests/unit/test_extract_job.py`` checks that the estimate is never below the real
canvas on the demo tokenizer.
"""

from __future__ import annotations

import json

from scheduler.jobs.schema_subset import (
    AnyOfNode,
    ArrayNode,
    EnumNode,
    IntegerNode,
    Node,
    NumberNode,
    ObjectNode,
    StringNode,
)

STRING_TOKENS = 12  # CanvasOptions.string_tokens: a string's capacity without a smaller maxLength
ARRAY_ITEMS = 3  # CanvasOptions.array_items: an array's items without a smaller maxItems
FREE_PAIRS = 2  # CanvasOptions.free_pairs: key/value pairs of an object without properties
INTEGER_DIGITS = 6  # CanvasOptions.integer_digits: digits of a wide integer
DATE_POSITIONS = 1 + 3 + 1 + len("MM-DD")  # lead digit, three digits, "-", the month-day choice
FREE_KEY_CHARS = 16  # a free pair's key: StringNode(1, 16)


def estimate_canvas_tokens(node: Node) -> int:
    """Positions the canvas of ``node`` takes at most (see the module docstring)."""
    if isinstance(node, EnumNode):
        return max(len(json.dumps(value, ensure_ascii=False)) for value in node.values)
    if isinstance(node, StringNode):
        return 2 + (DATE_POSITIONS if node.date else _string_room(node))
    if isinstance(node, IntegerNode):
        return _integer(node.lo, node.hi)
    if isinstance(node, NumberNode):
        lo = None if node.lo is None else int(node.lo)
        hi = None if node.hi is None else int(node.hi)
        return _integer(lo, hi) + 3  # "." and two digits (a narrow range: a shorter choice)
    if isinstance(node, ArrayNode):
        count = ARRAY_ITEMS if node.max_items is None else min(node.max_items, ARRAY_ITEMS)
        count = max(count, node.min_items)
        return 2 + count * (estimate_canvas_tokens(node.item) + 2)  # item, separator or its gate
    if isinstance(node, ObjectNode):
        if node.free:
            key = min(FREE_KEY_CHARS, STRING_TOKENS)
            return 2 + FREE_PAIRS * (len('", "') + key + len('": "') + STRING_TOKENS + 1)
        return 2 + sum(len(json.dumps(p.name, ensure_ascii=False)) + 4 + estimate_canvas_tokens(p.node)
                       for p in node.properties)
    assert isinstance(node, AnyOfNode)
    # every branch is laid out, after a choice slot that picks one
    return len(str(len(node.branches))) + sum(1 + estimate_canvas_tokens(b) for b in node.branches)


def _string_room(node: StringNode) -> int:
    room = max(STRING_TOKENS, node.min_length)
    return room if node.max_length is None else min(node.max_length, room)


def _integer(lo: int | None, hi: int | None) -> int:
    """A sign gate and a box of digits, or a choice among spread values as long as the bounds."""
    widest = max(len(str(lo)) if lo is not None else 0, len(str(hi)) if hi is not None else 0)
    return max(1 + INTEGER_DIGITS, widest + 1)
