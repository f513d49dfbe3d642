"""bench.structured at tiny sizes: both modes decode the same positions, the constrained outputs
validate, passes and the constraint's time are counted (and the clock leaves the engine as it
was), and the auto tool-call count runs the worker's path. Structure only, never speed."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from bench.structured import (
    _CONSTRAINT_PATHS,
    SCHEMAS,
    ConstraintClock,
    auto_calls,
    build_rows,
    canvas_shares,
    compare,
)
from worker.model.checkpoint import load_checkpoint


def test_constrained_and_unconstrained_decode_the_same_positions(demo_checkpoint: Path) -> None:
    lm = load_checkpoint(demo_checkpoint)
    block = lm.config.block_size or 4
    rows = build_rows(lm, 3)
    assert [r.name for r in rows] == list(SCHEMAS)
    for row in rows:
        assert (len(row.prompt) + row.length) % block == 0  # both modes end on a block boundary
        shares = canvas_shares(row.canvas)
        assert abs(shares["given"] + shares["choice"] + shares["token"] - 1) < 1e-9
        assert 0 < shares["given"] < 1

    originals = {name: vars(owner)[name] for owner, name in _CONSTRAINT_PATHS}
    clock = ConstraintClock()
    plain, shaped = compare(lm, batch=3, repeats=1, clock=clock)
    assert {name: vars(owner)[name] for owner, name in _CONSTRAINT_PATHS} == originals

    assert plain.tokens == shaped.tokens == sum(r.length for r in rows)
    assert plain.row_passes > 0 and shaped.row_passes > 0 and plain.passes > 0 and shaped.passes > 0
    assert shaped.passes_per_token > 0 and plain.passes_per_token > 0
    assert shaped.constraint_s > 0 and 0 < shaped.constraint_share < 1
    assert clock.calls["_restrict_ids"] > 0 and clock.calls["_choose_sequences"] > 0
    assert shaped.valid == shaped.outputs == 3
    for row, text in zip(rows, shaped.texts, strict=True):  # judged here too, not only by the bench
        checker = jsonschema.FormatChecker()
        validator = jsonschema.Draft202012Validator(SCHEMAS[row.name], format_checker=checker)
        validator.validate(json.loads(text))


def test_auto_tool_calls_are_counted_through_the_worker_path(demo_checkpoint: Path) -> None:
    lm = load_checkpoint(demo_checkpoint)
    figures = auto_calls(lm, "tiny", requests=2, max_new_tokens=8, temperature=0.7, batch=2)
    assert figures.requests == 2 and figures.attempted + figures.none == 2
    assert figures.well_formed <= figures.attempted and figures.calls_returned <= 2
    assert len(figures.samples) == 2
