"""``GET /v1/jobs/{id}/events``: a job's life as Server-Sent Events, live.

Events, in order (``data`` is JSON):

- ``status``: ``{"job_id", "status", "attempt", "queue", "cancel_requested"}``, first and then
  on every status or attempt change (SQL's view: a retry shows ``queued`` then ``running`` with
  the next attempt, and its text starts again at offset 0);
- ``progress``: the counters after each committed block (``blocks_done``, ``blocks_total``,
  ``steps_used``, ``step_budget``, ``tokens_committed``, ``attempt``);
- ``delta``: the text that block committed, ``{"attempt", "offset", "text"}`` (the job's text is
  ``text_so_far[:offset] + text``), plus ``reasoning_offset`` / ``reasoning`` for thinking mode;
- ``result``: the final job, exactly ``GET /v1/jobs/{id}``; the stream ends after it. Just
  before it, when the deltas sent do not add up to the stored text (a block the stream lost, the
  last bytes the worker's decoder held back), one more ``delta`` (no ``id``) carries the rest, so
  the deltas of every stream always add up to the job's stored ``result.text`` (and reasoning).

``progress`` and ``delta`` carry the stream entry id as the SSE ``id``: a client that reconnects
with ``Last-Event-ID`` (browsers' ``EventSource`` do) or ``?after=`` resumes after it; without
one the job's output so far is replayed from its start. SQL stays the truth: the status and the
result are read from it, and the ``result`` event is complete on its own. A comment line is
sent every few seconds while nothing happens. A replica that stops ends its streams by the end
of its drain (``api/drain.py``) without ``result``: reconnect with ``Last-Event-ID`` (through the
load balancer, to another replica) and the stream goes on after the last event received.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.deps import JobReaderDep, ReadCaller, visible_tenant
from api.errors import ApiError
from api.job_follow import Followed, completion, follow_job, rebuilt
from api.json_input import LimitedJsonRoute
from api.schemas.errors import error_responses
from api.schemas.jobs import JobOut
from api.sse import SSE_HEADERS, EventStreamResponse, sse_comment, sse_event
from scheduler.jobs.event_stream import valid_entry_id

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=error_responses(401, 429),
                   route_class=LimitedJsonRoute)

PROGRESS_FIELDS = ("blocks_done", "blocks_total", "steps_used", "step_budget", "tokens_committed")


def _not_found(job_id: str) -> ApiError:
    return ApiError(404, "job_not_found", f"No job with id '{job_id}'.", {"job_id": job_id})


def _status(job: JobOut) -> dict[str, Any]:
    return {"job_id": job.id, "status": job.status, "attempt": job.attempt, "queue": job.queue,
            "cancel_requested": job.cancel_requested}


def render(item: Followed) -> str:
    """One followed happening as SSE text (empty when it has nothing to say)."""
    if item.kind == "keepalive":
        return sse_comment("keep-alive")
    if item.kind == "status":
        assert item.job is not None
        return sse_event("status", _status(item.job))
    if item.kind == "final":
        assert item.job is not None
        return sse_event("result", json.loads(item.job.model_dump_json()))
    event = item.event or {}
    progress = {name: event.get(name) for name in PROGRESS_FIELDS}
    progress["attempt"] = event.get("attempt")
    text = sse_event("progress", progress, event_id=item.entry_id)
    delta = {"attempt": event.get("attempt"), "offset": event.get("offset", 0),
             "text": event.get("delta", "")}
    if "reasoning_delta" in event:
        delta["reasoning_offset"] = event.get("reasoning_offset", 0)
        delta["reasoning"] = event.get("reasoning_delta", "")
    if delta["text"] or delta.get("reasoning"):
        text += sse_event("delta", delta, event_id=item.entry_id)
    return text


def final_delta(job: JobOut, answer: str, reasoning: str) -> dict[str, Any] | None:
    """The ``delta`` that completes the text the stream's deltas built to the stored result (None
    when they agree, or when the job has no text: failed, cancelled before any block)."""
    result = job.result
    if result is None:
        return None
    text = completion(answer, result.text or "")
    thought = completion(reasoning, result.reasoning or "") if result.reasoning is not None else None
    if text is None and thought is None:
        return None
    delta: dict[str, Any] = {"attempt": job.attempt, "offset": len(answer), "text": ""}
    if text is not None:
        delta["offset"], delta["text"] = text
    if thought is not None:
        delta["reasoning_offset"], delta["reasoning"] = thought
    return delta


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}},
                     "description": "status, progress, delta and result events (see the module doc)."},
               **error_responses(401, 403, 404, 422, 503)},
)
async def job_events(
    job_id: str,
    caller: ReadCaller,
    reader: JobReaderDep,
    after: Annotated[str | None, Query(max_length=64, description="Resume after this event id.")] = None,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=64)] = None,
) -> StreamingResponse:
    """Stream the job's status changes, progress and committed-text deltas, then its result."""
    resume = after or last_event_id
    if resume is not None and not valid_entry_id(resume):
        message = "after / Last-Event-ID must be an event id this stream sent (e.g. 1700000000000-0)"
        raise ApiError(422, "invalid_request", message, [{"loc": ["query", "after"], "message": message}])
    try:
        parsed = str(uuid.UUID(job_id))
    except ValueError:
        raise _not_found(job_id) from None
    tenant = visible_tenant(caller)
    first = await run_in_threadpool(reader.read, parsed, tenant)
    if first is None:
        raise _not_found(job_id)

    async def body() -> AsyncIterator[str]:
        yield "retry: 1000\n\n"
        answer = reasoning = ""  # what the deltas sent so far add up to
        drain = reader.drain  # a stopping replica ends the stream; the client resumes elsewhere
        following = follow_job(reader, parsed, tenant, after=resume, first=first, drain=drain)
        ended = False
        async with aclosing(following) as followed:
            async for item in followed:
                ended = ended or item.kind == "final"
                if item.kind == "block" and item.event is not None:
                    answer = rebuilt(answer, item.event.get("offset", 0), item.event.get("delta", ""))
                    reasoning = rebuilt(reasoning, item.event.get("reasoning_offset", 0),
                                        item.event.get("reasoning_delta", ""))
                elif item.kind == "final" and item.job is not None and resume is None:
                    rest = final_delta(item.job, answer, reasoning)
                    if rest is not None:
                        yield sse_event("delta", rest)
                text = render(item)
                if text:
                    yield text
        if not ended and drain.draining:  # the replica stops (api/drain.py): reconnect with Last-Event-ID
            yield sse_comment("replica stopping: reconnect with Last-Event-ID")

    return EventStreamResponse(body(), headers=SSE_HEADERS)
