"""Structured JSON logs for every cloverq process (structlog), and the request id that ties them.

* :func:`configure_logging` is called once per process (api, worker, beat, CLI services). It
  renders structlog events AND stdlib records (uvicorn, celery, alembic) as one JSON object
  per line, so an operator can ``jq`` a single stream.
* A request id enters at the API (``X-Request-ID`` header, or a fresh one), lives in a
  contextvar while the request is served (:func:`bind_request_id`), is stored on the job row,
  and the worker binds it again (:func:`bound_job_context`) so its job log lines carry it.
* Prompts, contexts and outputs are dropped from every event unless
  ``settings.observability.log_payloads`` (``CLOVERQ_LOG_PAYLOADS=true``); secrets are dropped always.
* :func:`log_job_finished` writes the one summary line per finished job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import uuid
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any, TextIO

import structlog
from celery import signals
from structlog.contextvars import bind_contextvars, bound_contextvars, get_contextvars
from structlog.types import EventDict, Processor, WrappedLogger

from scheduler.infra.settings import Settings
from scheduler.infra.settings_env import unknown_variables
from scheduler.observability.redaction import redact_secrets
from scheduler.observability.tracing import add_trace_ids

REQUEST_ID_HEADER = "X-Request-ID"
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

# Event keys that may hold user content: dropped unless payload logging is on.
PAYLOAD_KEYS: frozenset[str] = frozenset(
    {
        "prompt",
        "messages",
        "input",
        "context",
        "contexts",
        "output",
        "text",
        "partial_text",
        "result",
        "token_ids",
        "completion",
        "question",
        "questions",
    }
)
# Event keys that may hold credentials: always dropped.
SECRET_KEYS: frozenset[str] = frozenset(
    {"authorization", "api_key", "key", "secret", "password", "token", "bearer", "cookie"}
)
REDACTED = "[redacted]"


def new_request_id() -> str:
    """A fresh request id (32 hex characters)."""
    return uuid.uuid4().hex


def accept_request_id(header_value: str | None) -> str:
    """The caller's ``X-Request-ID`` if it is a sane token, else a fresh id (a header must
    never inject arbitrary text or huge values into logs and job rows)."""
    if header_value and _REQUEST_ID_RE.match(header_value):
        return header_value
    return new_request_id()


def bind_request_id(request_id: str) -> None:
    """Attach the request id to every log line of the current context (task / thread)."""
    bind_contextvars(request_id=request_id)


def current_request_id() -> str | None:
    """The request id bound in this context, if any (the submit route stores it on the job)."""
    value = get_contextvars().get("request_id")
    return str(value) if value is not None else None


@contextlib.contextmanager
def bound_job_context(
    *,
    job_id: str,
    kind: str,
    queue: str,
    attempt: int,
    request_id: str | None = None,
    model_version: str | None = None,
) -> Iterator[None]:
    """Bind the job's identity to every log line emitted while the worker runs it (unknown
    values are left unbound so an outer request id is not masked by ``None``)."""
    fields: dict[str, Any] = {"job_id": job_id, "kind": kind, "queue": queue, "attempt": attempt}
    if request_id is not None:
        fields["request_id"] = request_id
    if model_version is not None:
        fields["model_version"] = model_version
    with bound_contextvars(**fields):
        yield


def drop_payloads(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    """Processor: replace user content with a marker (used when payload logging is off)."""
    for key in PAYLOAD_KEYS.intersection(event_dict):
        event_dict[key] = REDACTED
    return event_dict


def drop_secrets(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    """Processor: never let a credential reach a log line, whatever the caller passed."""
    for key in list(event_dict):
        if key.lower() in SECRET_KEYS:
            event_dict[key] = REDACTED
    return event_dict


def _drop_color_message(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    """uvicorn adds a duplicate ANSI-coloured message to its records; keep the plain one."""
    event_dict.pop("color_message", None)
    return event_dict


def shared_processors(settings: Settings) -> list[Processor]:
    """Processors applied to structlog events and stdlib records alike."""
    processors: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _drop_color_message,
        drop_secrets,
        redact_secrets,  # keys, bearer tokens and URL passwords inside any value
    ]
    if settings.observability.tracing_enabled:  # trace_id / span_id inside a recorded span
        processors.append(add_trace_ids)
    if not settings.observability.log_payloads:
        processors.append(drop_payloads)
    return processors


def configure_logging(settings: Settings, *, stream: TextIO | None = None) -> None:
    """Route structlog and stdlib logging to one JSON-lines stream (stderr by default)."""
    level = logging.getLevelName(settings.observability.log_level.upper())
    if not isinstance(level, int):
        level = logging.INFO
    shared = shared_processors(settings)
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
    )
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "celery", "alembic"):
        lib_logger = logging.getLogger(name)
        # Whoever configured these before (uvicorn.Config's log_level, a dictConfig) may have left
        # a level or ``disabled``; the root's level and handler decide from here on.
        lib_logger.handlers.clear()
        lib_logger.setLevel(logging.NOTSET)
        lib_logger.disabled = False
        lib_logger.propagate = True
    warn_unknown_variables(os.environ)


def warn_unknown_variables(environ: Mapping[str, str]) -> None:
    """Log the ``CLOVERQ_`` variables no setting reads (``settings.unknown_variables``), with the
    setting each most resembles: here because every process calls :func:`configure_logging` once
    its settings are loaded, and a misspelt variable otherwise changes nothing without a word."""
    unknown = unknown_variables(environ, Settings)
    if unknown:
        structlog.get_logger(__name__).warning(
            "settings.unknown_variables", variables=list(unknown),
            did_you_mean={name: close for name, close in unknown.items() if close is not None})


def _leave_logging_alone(**_: Any) -> None:
    """Celery ``setup_logging`` receiver: its presence stops Celery from reconfiguring logging."""


def configure_celery_logging(settings: Settings) -> None:
    """:func:`configure_logging` for a Celery process (worker, beat): Celery must not replace it."""
    configure_logging(settings)
    signals.setup_logging.connect(_leave_logging_alone, weak=False)


def get_logger(name: str | None = None) -> Any:
    """A structlog logger (``.info("event", key=value)``)."""
    return structlog.get_logger(name)


def log_job_finished(
    logger: Any,
    *,
    job_id: str,
    kind: str,
    queue: str,
    status: str,
    attempt: int,
    steps_used: int | None,
    step_budget: int | None,
    tokens: int | None,
    model_version: str | None,
    wait_seconds: float | None,
    run_seconds: float | None,
    finish_reason: str | None = None,
    error_code: str | None = None,
    request_id: str | None = None,
) -> None:
    """The one summary line of a finished job (event ``job.finished``)."""
    fields: MutableMapping[str, Any] = {
        "job_id": job_id,
        "kind": kind,
        "queue": queue,
        "status": status,
        "attempt": attempt,
        "steps_used": steps_used,
        "step_budget": step_budget,
        "tokens": tokens,
        "model_version": model_version,
        "wait_seconds": None if wait_seconds is None else round(wait_seconds, 4),
        "run_seconds": None if run_seconds is None else round(run_seconds, 4),
        "finish_reason": finish_reason,
        "error_code": error_code,
    }
    if request_id is not None:
        fields["request_id"] = request_id
    logger.info("job.finished", **fields)
