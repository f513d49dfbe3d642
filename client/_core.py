"""What the sync and async clients share: errors, retry policy, request bodies, SSE parsing."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from client.models import JobEvent

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
RETRY_STATUSES = frozenset({429, 503})
MAX_LONG_POLL_SECONDS = 30.0  # the server's limit of ?wait=


class CloverqError(Exception):
    """An error answer of the API: ``status``, the stable ``code``, ``message``, ``details``."""

    def __init__(self, status: int, code: str, message: str, details: Any = None,
                 retry_after: float | None = None) -> None:
        super().__init__(f"{code} (HTTP {status}): {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details
        self.retry_after = retry_after

    @classmethod
    def from_response(cls, response: httpx.Response) -> CloverqError:
        try:
            body = response.json()
        except ValueError:
            body = None
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict):
            return cls(response.status_code, "error", response.text[:500], None, retry_after(response))
        return cls(response.status_code, str(error.get("code") or "error"), str(error.get("message") or ""),
                   error.get("details"), retry_after(response))


class JobTimeout(TimeoutError):
    """``wait`` gave up before the job was final (the job goes on; ``job`` is its last view)."""

    def __init__(self, job: Any) -> None:
        super().__init__(f"job {job.id} is still {job.status}")
        self.job = job


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of answers that say "later": 429 (rate limit, queue or tenant cap: nothing was
    stored) and 503 (database unreachable), plus connection failures (nothing was sent).

    The wait is the answer's ``Retry-After`` when it has one (capped at ``max_delay``), else
    exponential from ``backoff`` with jitter. Submissions always carry an ``Idempotency-Key``
    (the client makes one when none is given), so a retried submit can never create two jobs."""

    max_retries: int = 3
    backoff: float = 0.5
    max_delay: float = 60.0

    def delay(self, attempt: int, response: httpx.Response | None) -> float:
        hinted = retry_after(response) if response is not None else None
        if hinted is not None:
            return min(max(hinted, 0.0), self.max_delay)
        return min(self.backoff * (2 ** attempt) * (1 + random.random() / 4), self.max_delay)


def retry_after(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds (a number of seconds or an HTTP date), None without one."""
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def idempotency_headers(key: str | None) -> dict[str, str]:
    return {"Idempotency-Key": key or f"cloverq-client-{uuid.uuid4().hex}"}


def generate_body(prompt: str | None, messages: Sequence[Mapping[str, str]] | None,
                  params: Mapping[str, Any] | None, *, priority: str | None,
                  metadata: Mapping[str, Any] | None, webhook_url: str | None) -> dict[str, Any]:
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    job_input: dict[str, Any] = (
        {"prompt": prompt} if prompt is not None else {"messages": [dict(m) for m in messages or ()]}
    )
    return _job_body("generate", job_input, params, priority=priority, metadata=metadata,
                     webhook_url=webhook_url)


def decide_body(context: str, questions: Sequence[Mapping[str, Any]], *, mode: str, rationale: bool,
                params: Mapping[str, Any] | None, priority: str | None,
                metadata: Mapping[str, Any] | None, webhook_url: str | None,
                constraints: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    job_input: dict[str, Any] = {"context": context, "questions": [dict(q) for q in questions], "mode": mode,
                                 "rationale": rationale}
    if constraints:
        job_input["constraints"] = [dict(c) for c in constraints]
    return _job_body("decide", job_input, params, priority=priority, metadata=metadata,
                     webhook_url=webhook_url)


def extract_body(context: str, schema: Mapping[str, Any], *, instructions: str | None,
                 params: Mapping[str, Any] | None, priority: str | None,
                 metadata: Mapping[str, Any] | None, webhook_url: str | None) -> dict[str, Any]:
    job_input: dict[str, Any] = {"context": context, "schema": dict(schema)}
    if instructions is not None:
        job_input["instructions"] = instructions
    return _job_body("extract", job_input, params, priority=priority, metadata=metadata,
                     webhook_url=webhook_url)


def _job_body(kind: str, job_input: dict[str, Any], params: Mapping[str, Any] | None, *,
              priority: str | None, metadata: Mapping[str, Any] | None,
              webhook_url: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": kind, "input": job_input,
                            "params": {k: v for k, v in (params or {}).items() if v is not None}}
    if priority is not None:
        body["priority"] = priority
    if metadata is not None:
        body["metadata"] = dict(metadata)
    if webhook_url is not None:
        body["webhook_url"] = webhook_url
    return body


def list_query(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


# The comment an API replica ends a job's event stream with when it stops (the server's
# api/routes/job_events.py): the stream goes on from another replica after a reconnect.
REPLICA_STOPPING = "replica stopping"


class SSEParser:
    """Incremental Server-Sent Events parser: feed lines, get :class:`JobEvent` s. ``stopping``:
    the server said it is stopping (the stream ends; reconnect with ``last_id`` to go on)."""

    def __init__(self) -> None:
        self._event: str | None = None
        self._data: list[str] = []
        self._id: str | None = None
        self.last_id: str | None = None
        self.stopping = False

    def feed(self, line: str) -> JobEvent | None:
        line = line.rstrip("\r")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            self.stopping = self.stopping or line[1:].strip().startswith(REPLICA_STOPPING)
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            self._id = value
        return None

    def _dispatch(self) -> JobEvent | None:
        if not self._data:
            self._event = None
            return None
        raw = "\n".join(self._data)
        event = self._event or "message"
        event_id = self._id
        self._event, self._data, self._id = None, [], None
        if event_id is not None:
            self.last_id = event_id
        try:
            data = json.loads(raw)
        except ValueError:
            data = {"raw": raw}
        return JobEvent(event=event, data=data if isinstance(data, dict) else {"value": data}, id=event_id)


def parse_lines(lines: Iterable[str]) -> list[JobEvent]:
    """Every event in ``lines`` (for tests and small buffers)."""
    parser = SSEParser()
    events = [parser.feed(line) for line in lines]
    return [e for e in events if e is not None]
