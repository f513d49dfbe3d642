"""Server-Sent Events: the wire format and a streaming response that always cleans up.

``EventStreamResponse`` closes its body iterator however the response ends (finished, client
gone, server stopping), so a generator's ``finally`` (e.g. cancelling the job of a client that
disconnected) runs at once, not whenever the garbage collector gets to it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import suppress
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_HEADERS: Mapping[str, str] = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: pass each event through at once
}


def _json(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def sse_event(name: str | None, data: Any, *, event_id: str | None = None) -> str:
    """One event: optional ``id`` and ``event`` lines, then the JSON ``data`` line."""
    lines = []
    if event_id is not None:
        lines.append(f"id: {event_id}")
    if name is not None:
        lines.append(f"event: {name}")
    lines.append(f"data: {data if isinstance(data, str) else _json(data)}")
    return "\n".join(lines) + "\n\n"


def sse_comment(text: str) -> str:
    """A comment line (ignored by clients; keeps proxies and disconnect detection busy)."""
    return f": {text}\n\n"


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` whose body iterator is always closed when the response ends."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            iterator = self.body_iterator
            if isinstance(iterator, AsyncIterator) and hasattr(iterator, "aclose"):
                with anyio.CancelScope(shield=True), suppress(Exception):
                    await iterator.aclose()
