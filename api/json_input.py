"""The one parser of client JSON: bounded nesting, bounded numbers, strict JSON only.

``json.loads`` alone turns hostile bodies into server errors: 10,000 nested brackets raise
``RecursionError``, a 5,000-digit integer raises a ``ValueError`` (Python's int-to-str digit
limit), and the non-standard literals ``NaN`` / ``Infinity`` (or ``1e999``, which overflows to
infinity) are accepted although strict JSON, PostgreSQL's json type and our own error renderer refuse
them. :func:`loads` bounds the nesting depth and the length of every number literal, refuses
non-finite numbers, and reports every refusal as :class:`JsonInputError`, a
``json.JSONDecodeError``: every caller that already handles malformed JSON handles these too.

Every place that parses client JSON uses it: request bodies of FastAPI routes (through
:class:`LimitedJsonRoute`, the ``route_class`` of the API's routers) and the batch upload
formats (JSON, JSONL lines, multipart metadata) in ``api/routes/batches.py``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

MAX_DEPTH = 64  # job specs nest about 5 levels; nothing legitimate comes near this
MAX_NUMBER_CHARS = 64  # seeds (the largest numbers a request carries) have at most 19 digits


class JsonInputError(json.JSONDecodeError):
    """Client JSON refused: malformed, nested too deeply, a number too long, or not finite."""

    def __init__(self, msg: str) -> None:
        # No document kept (it may be a 64 MB upload): position 0 of an empty document.
        super().__init__(msg, "", 0)


def _parse_int(literal: str) -> int:
    if len(literal) > MAX_NUMBER_CHARS:
        raise JsonInputError(f"a number has more than {MAX_NUMBER_CHARS} characters")
    return int(literal)


def _parse_float(literal: str) -> float:
    if len(literal) > MAX_NUMBER_CHARS:
        raise JsonInputError(f"a number has more than {MAX_NUMBER_CHARS} characters")
    value = float(literal)
    if not math.isfinite(value):
        raise JsonInputError(f"the number {literal} is out of range")
    return value


def _parse_constant(name: str) -> Any:
    raise JsonInputError(f"{name} is not JSON (only finite numbers are)")


def _depth_exceeds(value: Any, limit: int) -> bool:
    """True when ``value`` nests objects/arrays more than ``limit`` levels deep (no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def loads(data: str | bytes | bytearray, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse client JSON; raises :class:`JsonInputError` for anything but bounded, strict JSON."""
    try:
        value = json.loads(data, parse_int=_parse_int, parse_float=_parse_float,
                           parse_constant=_parse_constant)
    except JsonInputError:
        raise
    except json.JSONDecodeError as exc:
        raise JsonInputError(f"{exc.msg} (line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise JsonInputError(f"nested more than {max_depth} levels deep") from None
    except UnicodeDecodeError:
        raise JsonInputError("the body is not UTF-8") from None
    except ValueError as exc:  # any other refusal of the decoder (never a 5xx)
        raise JsonInputError(str(exc)) from None
    if isinstance(value, (dict, list)) and _depth_exceeds(value, max_depth):
        raise JsonInputError(f"nested more than {max_depth} levels deep")
    return value


class LimitedJsonRequest(Request):
    """A request whose ``json()`` is :func:`loads` (what FastAPI parses JSON bodies with)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class LimitedJsonRoute(APIRoute):
    """``route_class`` of every API router: JSON bodies are parsed by :func:`loads`.

    FastAPI turns a ``json.JSONDecodeError`` from ``Request.json()`` into a 422 validation
    error, so a refused body answers exactly like malformed JSON.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def limited(request: Request) -> Response:
            return await handler(LimitedJsonRequest(request.scope, request.receive))

        return limited
