"""A job's live events on a Redis stream, for streaming readers (SSE, OpenAI ``stream: true``).

The worker's monitor (``worker/monitor.py``) appends to ``redis_keys.events(job_id)``:

- ``{"type": "status", "status": "running", "attempt": n}`` when it starts an attempt, and a
  ``status`` event with the attempt's end (``succeeded``, ``failed``, ``cancelled``, ``queued``
  for a retry, ``lost``) after the outcome is committed to SQL;
- ``{"type": "block", "attempt", "blocks_done", "blocks_total", "steps_used", "step_budget",
  "tokens_committed", "offset", "delta"}`` once per committed block, where the committed text
  is ``text[:offset] + delta`` (``offset`` is the length of the text already published, so a
  reader can apply deltas idempotently and resume anywhere). Thinking-mode jobs carry the
  reasoning the same way in ``reasoning_offset`` / ``reasoning_delta``.

The stream is transport, never the truth (docs/architecture.md §3.1): it is capped, expires
an hour after its last event (ten minutes once the attempt ended), and is lost with Redis.
Readers take a job's status and result from SQL and use the stream only for what happens in
between; a reader that finds no stream falls back to the hot status (``partial_text``) and to
SQL.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from scheduler.infra import redis_keys

EVENTS_TTL_SECONDS = 3600  # while the job runs: refreshed by every event
FINISHED_TTL_SECONDS = 600  # after an attempt ended (replays only; the result is in SQL)
EVENTS_MAXLEN = 20_000  # approximate cap (XADD MAXLEN ~): a 2048-token job in blocks of 1 fits
FIELD = "e"  # each entry holds one JSON document under this field
STREAM_START = "0-0"  # read a stream from its first entry


def status_event(status: str, attempt: int) -> dict[str, Any]:
    """The event of an attempt starting (``running``) or ending."""
    return {"type": "status", "status": status, "attempt": attempt}


def add_events(pipe: Any, job_id: object, events: Iterable[Mapping[str, Any]], *,
               ttl_seconds: int = EVENTS_TTL_SECONDS) -> int:
    """Queue ``XADD`` of every event (and the stream's expiry) on a Redis pipeline; returns how
    many were queued. Execute the pipeline yourself (one round trip for many jobs)."""
    key = redis_keys.events(job_id)
    count = 0
    for event in events:
        pipe.xadd(key, {FIELD: json.dumps(event, separators=(",", ":"))}, maxlen=EVENTS_MAXLEN,
                  approximate=True)
        count += 1
    if count:
        pipe.expire(key, ttl_seconds)
    return count


def parse_entries(entries: Sequence[Any]) -> list[tuple[str, dict[str, Any]]]:
    """``[(entry_id, event)]`` from the entries of an ``XREAD`` / ``XRANGE`` answer (bytes or
    str); entries that are not ours are skipped."""
    parsed: list[tuple[str, dict[str, Any]]] = []
    for entry_id, fields in entries:
        raw = fields.get(FIELD) if FIELD in fields else fields.get(FIELD.encode())
        if raw is None:
            continue
        try:
            event = json.loads(raw)
        except (TypeError, ValueError):
            continue
        if isinstance(event, dict):
            parsed.append((entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id), event))
    return parsed


def valid_entry_id(value: str) -> bool:
    """Whether ``value`` can be passed to XREAD as the id to read after (``ms-seq`` or ``ms``)."""
    parts = value.split("-")
    return 1 <= len(parts) <= 2 and all(p.isdigit() and len(p) <= 20 for p in parts)
