"""JSON given on the command line (``--messages``, ``--questions``, ``--metadata``, a schema): parsed
here so a typo ends in one usage error that says which option and where the JSON breaks, not in
a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

_KINDS: dict[type, str] = {list: "a JSON list", dict: "a JSON object"}


def json_option(text: str, option: str, expected: type, shape: str = "", *, files: bool = False,
                one_line: bool = False) -> Any:
    """``text`` parsed as JSON of type ``expected`` (``list`` or ``dict``); ``files``: ``@PATH``
    reads the JSON from that file. ``shape`` follows the type in the error ("of {id, text}").
    ``one_line``: ``text`` is one line of a file that ``option`` names with its line number, so a
    syntax error gives the column alone."""
    source = text
    if files and text.startswith("@"):
        path = Path(text[1:])
        try:
            source = path.read_text()
        except OSError as exc:
            raise click.UsageError(f"{option}: cannot read {path}: {exc.strerror or exc}") from None
    try:
        value = json.loads(source)
    except json.JSONDecodeError as exc:
        place = f"column {exc.colno}" if one_line else f"line {exc.lineno}, column {exc.colno}"
        raise click.UsageError(f"{option} is not JSON: {exc.msg} ({place})") from None
    if not isinstance(value, expected):
        kind = _KINDS.get(expected, expected.__name__)
        raise click.UsageError(f"{option} must be {kind}{' ' + shape if shape else ''}, "
                               f"not {type(value).__name__}")  # fmt: skip
    return value
