"""Lay a parsed schema out as an infill canvas: fixed structure tokens plus constrained slots.

The canvas is an :class:`InfillTemplate` the engine decodes after the prompt: braces, quotes,
keys, commas (or a tool call's XML tags) are fixed tokens; every value is one or more slots. The
slot rules (docs/structured.md):

* enum / const / boolean / null / an integer over at most ``enum_max`` values: one choice slot
  among the values' tokenizations (padded), committed as a unit like a decision's answer; a
  single value is fixed tokens.
* string: ``"`` + a pad-tail slot of ``capacity`` positions over JSON-safe content tokens + ``"``.
  ``maxLength`` m: capacity min(m, string_tokens) and tokens of at most m // capacity characters;
  ``minLength`` n: the first n positions never take the pad. ``format: date``: a 1-9 digit, three
  digits, ``-`` and a choice among the 365 valid ``MM-DD``.
* integer, wide or unbounded: an optional ``-`` (a choice with the pad), a 1-9 digit, and a
  pad-tail slot of digits, with as many digits as keep every value inside the bounds; bounds
  that no such box fits (a high minimum) become a choice among ``enum_max`` evenly spread values.
* number: an integer part (the integer rule, bounds tightened by one so any fraction stays
  inside) + ``.`` + two digits; a range too narrow for that is a choice among spread values.
* array: ``maxItems`` (or ``array_items``, at least ``minItems``) item canvases; every item
  past ``minItems`` is behind a gate (a choice between its separator and pads): the array ends
  at the first closed gate.
* object: properties in schema order; a required one's key is fixed, an optional one's key is
  its gate (the key's tokens or pads). ``additionalProperties: false`` needs nothing: only
  declared properties are ever laid out. No properties and additional ones allowed (or
  ``json_object``): ``free_pairs`` gated string key/value pairs.
* anyOf: branches that are all choices merge into one choice; otherwise each branch is laid out
  and a choice slot picks the branch.

Reading the canvas back (:meth:`Canvas.read`) builds the value from the slots; the returned
text is its JSON serialization, which for these slots equals the canvas text with pads and
closed gates removed (string content never needs escaping).
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from scheduler.jobs import canvas_size
from scheduler.jobs.schema_subset import (
    AnyOfNode,
    ArrayNode,
    EnumNode,
    IntegerNode,
    Node,
    NumberNode,
    ObjectNode,
    SchemaError,
    SchemaErrorCode,
    StringNode,
)
from worker.engine.types import InfillSlot, InfillTemplate, SlotChoice
from worker.structured.vocab import CanvasTokenizer, decode_content, digit_ids, string_ids


@dataclass(frozen=True)
class CanvasOptions:
    """Room the canvas gives growing values. Jobs use the defaults (no setting changes them yet:
    docs/structured.md, "Not built yet"); tests and benches pass smaller rooms."""

    # The room defaults live in scheduler/jobs/canvas_size.py, whose estimate the router costs
    # extract jobs by (the scheduler may not import the worker; the worker imports it).
    string_tokens: int = canvas_size.STRING_TOKENS  # capacity of a string without a smaller maxLength
    array_items: int = canvas_size.ARRAY_ITEMS  # items of an array without a smaller maxItems
    free_pairs: int = canvas_size.FREE_PAIRS  # key/value pairs of an object without properties
    integer_digits: int = canvas_size.INTEGER_DIGITS  # digits of a wide integer
    enum_max: int = 128  # values of a spread choice
    max_tokens: int = 4096  # the whole canvas


_DATES = tuple((datetime.date(2001, 1, 1) + datetime.timedelta(days=d)).strftime("%m-%d") for d in range(365))


class _Reader:
    """Reads slot choices back into values, recording choice confidences by JSON pointer."""

    def __init__(self, choices: Sequence[SlotChoice], tokenizer: CanvasTokenizer, pad_id: int) -> None:
        self.choices = choices
        self.tokenizer = tokenizer
        self.pad_id = pad_id
        self.confidence: dict[str, float] = {}

    def index(self, slot: int) -> int:
        return self.choices[slot].index

    def text(self, slot: int) -> str:
        return decode_content(self.tokenizer, self.choices[slot].token_ids, self.pad_id)


@dataclass
class _Const:
    value: Any

    def read(self, r: _Reader, path: str) -> Any:
        return self.value


@dataclass
class _Choice:
    slot: int
    values: list[Any]

    def read(self, r: _Reader, path: str) -> Any:
        r.confidence[path or "/"] = r.choices[self.slot].confidence
        return self.values[r.index(self.slot)]


@dataclass
class _Text:
    slot: int | None  # None: maxLength 0

    def read(self, r: _Reader, path: str) -> Any:
        return "" if self.slot is None else r.text(self.slot)


@dataclass
class _Date:
    lead: int
    rest: int
    month_day: int

    def read(self, r: _Reader, path: str) -> Any:
        return f"{r.text(self.lead)}{r.text(self.rest)}-{_DATES[r.index(self.month_day)]}"


@dataclass
class _Integer:
    sign: int | None
    lead: int
    tail: int | None

    def read(self, r: _Reader, path: str) -> Any:
        negative = self.sign is not None and r.index(self.sign) == 0
        digits = r.text(self.lead) + ("" if self.tail is None else r.text(self.tail))
        return -int(digits) if negative else int(digits)


@dataclass
class _Number:
    whole: _Choice | _Integer | _Const
    fraction: int

    def read(self, r: _Reader, path: str) -> Any:
        whole = self.whole.read(r, path)
        return float(f"{whole}.{r.text(self.fraction)}")


@dataclass
class _Array:
    items: list[_CanvasNode]
    gates: list[int | None]  # per item: its gate slot (None: always present)

    def read(self, r: _Reader, path: str) -> Any:
        out = []
        for i, (item, gate) in enumerate(zip(self.items, self.gates, strict=True)):
            if gate is not None and r.index(gate) != 0:
                break
            out.append(item.read(r, f"{path}/{i}"))
        return out


@dataclass
class _Object:
    members: list[tuple[str, _CanvasNode, int | None]]  # (name, value, gate or None)

    def read(self, r: _Reader, path: str) -> Any:
        return {
            name: node.read(r, f"{path}/{_pointer(name)}")
            for name, node, gate in self.members
            if gate is None or r.index(gate) == 0
        }


@dataclass
class _FreeObject:
    pairs: list[tuple[int, int, int]]  # (gate, key slot, value slot)

    def read(self, r: _Reader, path: str) -> Any:
        return {r.text(key): r.text(value) for gate, key, value in self.pairs if r.index(gate) == 0}


@dataclass
class _AnyOf:
    selector: int
    branches: list[_CanvasNode]

    def read(self, r: _Reader, path: str) -> Any:
        return self.branches[r.index(self.selector)].read(r, path)


_CanvasNode = _Const | _Choice | _Text | _Date | _Integer | _Number | _Array | _Object | _FreeObject | _AnyOf


def _pointer(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


@dataclass
class ReadResult:
    value: Any
    text: str  # the value's JSON
    confidence: dict[str, float] = field(default_factory=dict)  # JSON pointer -> choice probability


@dataclass(frozen=True)
class Canvas:
    """A laid-out schema: the template to decode and how to read its slots back."""

    template: InfillTemplate
    root: _CanvasNode
    style: Literal["json", "xml"]

    def read(self, choices: Sequence[SlotChoice], tokenizer: CanvasTokenizer) -> ReadResult:
        """The value the decoded slots hold (``GenerationResult.slot_choices``)."""
        pad = self.template.pad_id
        if pad is None or len(choices) != len(self.template.slots):
            raise ValueError("slot choices do not match the canvas")
        reader = _Reader(choices, tokenizer, pad)
        value = self.root.read(reader, "")
        return ReadResult(value, json.dumps(value, ensure_ascii=False), reader.confidence)

    def choice_fills(self, value: Any) -> list[tuple[int, tuple[int, ...]]]:
        """The inverse of ``read`` for a canvas of choices: ``(slot index, tokens)`` per slot such
        that the decoded canvas reads back as ``value`` (training rows of the demo). Only a choice,
        or an object whose members are all required choices or constants, has one; anything else
        raises ``ValueError``."""
        members = self.root.members if isinstance(self.root, _Object) else [("", self.root, None)]
        fills = []
        for name, node, gate in members:
            if isinstance(node, _Const) and gate is None:
                continue
            if not isinstance(node, _Choice) or gate is not None:
                raise ValueError("only a canvas of required choices has fills")
            wanted = value[name] if isinstance(self.root, _Object) else value
            matches = [i for i, v in enumerate(node.values) if v == wanted and type(v) is type(wanted)]
            if not matches:
                raise ValueError(f"{wanted!r} is not a value of {name or 'the choice'}")
            sequences = self.template.slots[node.slot].allowed_sequences
            assert sequences is not None  # a choice slot always lists its sequences
            fills.append((node.slot, sequences[matches[0]]))
        return fills


class _Builder:
    """Appends fixed text and slots; one per canvas."""

    def __init__(self, tokenizer: CanvasTokenizer, options: CanvasOptions) -> None:
        self.tok = tokenizer
        self.opts = options
        self.pad = tokenizer.pad_token_id
        self.ids: list[int] = []
        self.slots: list[InfillSlot] = []

    def text(self, fragment: str) -> None:
        self.ids.extend(self.tok.encode(fragment))
        self._check_size()

    def _check_size(self) -> None:
        if len(self.ids) > self.opts.max_tokens:
            raise SchemaError(
                SchemaErrorCode.SCHEMA_TOO_LARGE, f"the output canvas exceeds {self.opts.max_tokens} tokens"
            )

    def _slot(self, slot: InfillSlot) -> int:
        self.slots.append(slot)
        self.ids.extend([self.pad] * slot.length)
        self._check_size()
        return len(self.slots) - 1

    def choice(self, texts: Sequence[str]) -> int:
        """A slot choosing one of ``texts`` (tokenized, padded to one length)."""
        encoded = [self.tok.encode(t) if t else [self.pad] for t in texts]
        length = max(len(e) for e in encoded)
        padded = tuple(tuple(e + [self.pad] * (length - len(e))) for e in encoded)
        return self._slot(InfillSlot(len(self.ids), length, allowed_sequences=padded))

    def gate(self, present: str) -> int:
        """Index 0 = present (``present``'s tokens), 1 = absent (pads)."""
        return self.choice([present, ""])

    def tokens(
        self, length: int, ids: tuple[int, ...], *, pad_tail: bool = False, min_tokens: int = 0
    ) -> int:
        return self._slot(
            InfillSlot(len(self.ids), length, allowed_token_ids=ids, pad_tail=pad_tail, min_tokens=min_tokens)
        )


class _Layout:
    def __init__(self, builder: _Builder, style: Literal["json", "xml"]) -> None:
        self.b = builder
        self.style = style

    def value(self, node: Node, *, raw_string: bool = False) -> _CanvasNode:
        """Lay out ``node``; ``raw_string``: a string without quotes (an XML parameter)."""
        b = self.b
        if isinstance(node, EnumNode):
            texts = [
                v if raw_string and isinstance(v, str) else json.dumps(v, ensure_ascii=False)
                for v in node.values
            ]
            if len(node.values) == 1:
                b.text(texts[0])
                return _Const(node.values[0])
            return _Choice(b.choice(texts), list(node.values))
        if isinstance(node, StringNode):
            quote = "" if raw_string else '"'
            if quote:
                b.text(quote)
            out = self._string(node, raw_string)
            if quote:
                b.text(quote)
            return out
        if isinstance(node, IntegerNode):
            return self._integer(node.lo, node.hi)
        if isinstance(node, NumberNode):
            return self._number(node)
        if isinstance(node, ArrayNode):
            return self._array(node)
        if isinstance(node, ObjectNode):
            return self._object(node)
        return self._any_of(node, raw_string)

    def _string(self, node: StringNode, raw: bool) -> _CanvasNode:
        b = self.b
        if node.date:
            lead = b.tokens(1, digit_ids(b.tok, "123456789"))
            rest = b.tokens(3, digit_ids(b.tok, "0123456789"))
            b.text("-")
            return _Date(lead, rest, b.choice(_DATES))
        cap = b.opts.string_tokens
        if node.max_length is not None:
            cap = min(node.max_length, max(cap, node.min_length))
        else:
            cap = max(cap, node.min_length)
        if cap == 0:
            return _Text(None)
        # every token has at least one character, so cap tokens of max_length // cap characters
        # never exceed max_length, and min_length content tokens reach min_length
        max_chars = 64 if node.max_length is None else node.max_length // cap
        ids = string_ids(b.tok, max_chars, "<" if raw else "")
        return _Text(b.tokens(cap, ids, pad_tail=True, min_tokens=node.min_length))

    def _integer(self, lo: int | None, hi: int | None) -> _Choice | _Integer | _Const:
        b = self.b
        n = b.opts.enum_max
        if lo is not None and hi is not None and hi - lo + 1 <= n:
            values: list[Any] = list(range(lo, hi + 1))
            if len(values) == 1:
                b.text(str(values[0]))
                return _Const(values[0])
            return _Choice(b.choice([str(v) for v in values]), values)
        digits = b.opts.integer_digits
        while digits > 0 and hi is not None and 10**digits - 1 > hi:
            digits -= 1
        if digits >= 1 and (lo is None or lo <= 1):
            sign = b.gate("-") if lo is None or lo <= -(10**digits - 1) else None
            lead = b.tokens(1, digit_ids(b.tok, "123456789"))
            tail = b.tokens(digits - 1, digit_ids(b.tok, "0123456789"), pad_tail=True) if digits > 1 else None
            return _Integer(sign, lead, tail)
        # a box of digits does not fit: spread values over the bounds (one side may be open)
        low = lo if lo is not None else (hi if hi is not None else 0) - 10**b.opts.integer_digits
        high = hi if hi is not None else low + 10**b.opts.integer_digits
        spread = sorted({low + round(k * (high - low) / (n - 1)) for k in range(n)})
        return _Choice(b.choice([str(v) for v in spread]), list(spread))

    def _number(self, node: NumberNode) -> _CanvasNode:
        b = self.b
        # integer part a: a + .dd lies in [a, a + 1) (a >= 0) or (a - 1, a] (a < 0), so bounds
        # tightened by one whole unit keep every fraction strictly inside
        lo = None if node.lo is None else math.ceil(node.lo) + 1
        hi = None if node.hi is None else math.floor(node.hi) - 1
        if lo is None or hi is None or lo <= hi:
            whole = self._integer(lo, hi)
            b.text(".")
            return _Number(whole, b.tokens(2, digit_ids(b.tok, "0123456789")))
        assert node.lo is not None and node.hi is not None
        n = b.opts.enum_max
        spread = sorted(
            {round(node.lo + k * (node.hi - node.lo) / (n - 1), 2) for k in range(n)}
            | ({node.lo} if not node.lo_exclusive else set())
            | ({node.hi} if not node.hi_exclusive else set())
        )
        inside = [
            v
            for v in spread
            if (v > node.lo if node.lo_exclusive else v >= node.lo)
            and (v < node.hi if node.hi_exclusive else v <= node.hi)
        ]
        if not inside:
            raise SchemaError(SchemaErrorCode.INVALID_SCHEMA, "the number range is too narrow to lay out")
        if len(inside) == 1:
            b.text(json.dumps(inside[0]))
            return _Const(inside[0])
        return _Choice(b.choice([json.dumps(v) for v in inside]), inside)

    def _array(self, node: ArrayNode) -> _CanvasNode:
        b = self.b
        count = b.opts.array_items if node.max_items is None else min(node.max_items, b.opts.array_items)
        count = max(count, node.min_items)
        b.text("[")
        items: list[_CanvasNode] = []
        gates: list[int | None] = []
        for i in range(count):
            sep = ", " if i else ""
            if i >= node.min_items:
                gates.append(b.gate(sep or " "))
            else:
                gates.append(None)
                if sep:
                    b.text(sep)
            items.append(self.value(node.item))
        b.text("]")
        return _Array(items, gates)

    def _object(self, node: ObjectNode) -> _CanvasNode:
        b = self.b
        if self.style == "xml":
            return self._xml_object(node)
        b.text("{")
        if node.free:
            pairs = []
            for i in range(b.opts.free_pairs):
                pair_gate = b.gate('", "' if i else '"')
                key_text = self._string(StringNode(1, 16, False), False)
                b.text('": "')
                value_text = self._string(StringNode(0, None, False), False)
                b.text('"')
                assert isinstance(key_text, _Text) and isinstance(value_text, _Text)
                assert key_text.slot is not None and value_text.slot is not None
                pairs.append((pair_gate, key_text.slot, value_text.slot))
            b.text("}")
            return _FreeObject(pairs)
        members: list[tuple[str, _CanvasNode, int | None]] = []
        for i, prop in enumerate(node.properties):
            key = ("," + " " if i else "") + json.dumps(prop.name, ensure_ascii=False) + ": "
            gate: int | None = None
            if prop.required:
                b.text(key)
            else:
                gate = b.gate(key)
            members.append((prop.name, self.value(prop.node), gate))
        b.text("}")
        return _Object(members)

    def _xml_object(self, node: ObjectNode) -> _CanvasNode:
        """A Qwen3 XML tool call's parameters: strings raw, everything else as JSON."""
        b = self.b
        self.style = "json"  # nested values are JSON
        members: list[tuple[str, _CanvasNode, int | None]] = []
        for prop in node.properties:
            tag = f"<parameter={prop.name}>\n"
            gate: int | None = None
            if prop.required:
                b.text(tag)
            else:
                gate = b.gate(tag)
            members.append((prop.name, self.value(prop.node, raw_string=True), gate))
            b.text("\n</parameter>\n")
        return _Object(members)

    def _any_of(self, node: AnyOfNode, raw_string: bool) -> _CanvasNode:
        b = self.b
        selector = b.choice([str(i) for i in range(len(node.branches))])
        branches = []
        for branch in node.branches:
            b.text(" ")
            branches.append(self.value(branch, raw_string=raw_string))
        return _AnyOf(selector, branches)


def compile_canvas(
    node: Node,
    tokenizer: CanvasTokenizer,
    options: CanvasOptions | None = None,
    *,
    style: Literal["json", "xml"] = "json",
    prefix: str = "",
    suffix: str = "",
) -> Canvas:
    """The canvas of a parsed schema; ``prefix``/``suffix`` are fixed text around it (a tool
    call's opening and closing tags). ``style="xml"``: the root object's properties as Qwen3 XML
    ``<parameter=...>`` blocks. Raises :class:`SchemaError` (canvas too large, empty range)."""
    builder = _Builder(tokenizer, options or CanvasOptions())
    if prefix:
        builder.text(prefix)
    if style == "xml" and not isinstance(node, ObjectNode):
        raise SchemaError(SchemaErrorCode.INVALID_SCHEMA, "tool parameters must be an object schema")
    root = _Layout(builder, style).value(node)
    if suffix:
        builder.text(suffix)
    template = InfillTemplate(token_ids=tuple(builder.ids), slots=tuple(builder.slots), pad_id=builder.pad)
    return Canvas(template, root, style)


def compile_choice(
    values: Sequence[str],
    tokenizer: CanvasTokenizer,
    *,
    prefix: str = "",
    suffix: str = "",
) -> Canvas:
    """A canvas of one choice among ``values`` between fixed text: which function a ``required``
    call over several tools names (``<tool_call>\\n<function=`` + a name + ``>\\n``); its value is
    the chosen text, its confidence the choice's probability."""
    builder = _Builder(tokenizer, CanvasOptions())
    if prefix:
        builder.text(prefix)
    root = _Choice(builder.choice(list(values)), list(values))
    if suffix:
        builder.text(suffix)
    template = InfillTemplate(token_ids=tuple(builder.ids), slots=tuple(builder.slots), pad_id=builder.pad)
    return Canvas(template, root, "json")
