"""The pad-tail rule: a slot that grows (a string, a number's digits) ends in a run of pads.

A structured canvas (``worker.structured``) gives a value that may be shorter than its room a
slot of ``capacity`` positions; the value is the slot's tokens with the pads removed. Diffusion
commits positions in any order, so "pads only as one contiguous tail" cannot be a per-position
mask fixed at layout time. It is enforced at commit time instead, by two checks on the slot's
committed tokens:

* once a pad is committed at slot offset ``k``, every later offset becomes a pad (committed at
  once, even if the same pass chose a content token there: the pad wins);
* once a content token is committed at offset ``k``, every earlier still-masked offset loses the
  pad from its allowed ids (it must hold content).

The first ``min_tokens`` offsets never allow the pad (a ``minLength``). So whatever order the
positions are committed in, the slot reads ``content* pad*`` with at least ``min_tokens`` content
tokens. Pure functions over the slot's tokens (``None`` = still masked); the sequence state
applies them.
"""

from __future__ import annotations

from collections.abc import Sequence


def forced_pads(slot_tokens: Sequence[int | None], pad_id: int) -> list[int]:
    """Slot offsets that must become pads now: every offset after the first committed pad that
    does not hold a pad yet (masked, or content committed in the same pass)."""
    first = next((k for k, t in enumerate(slot_tokens) if t == pad_id), None)
    if first is None:
        return []
    return [k for k in range(first + 1, len(slot_tokens)) if slot_tokens[k] != pad_id]


def content_required_before(slot_tokens: Sequence[int | None], pad_id: int, min_tokens: int) -> int:
    """Offsets below the returned one may not take the pad: the last committed content token's
    offset (everything before it must be content too), at least ``min_tokens``."""
    last = max((k for k, t in enumerate(slot_tokens) if t is not None and t != pad_id), default=-1)
    return max(last, min_tokens)
