"""JSON logs: request id propagation, the job summary line, payload and secret redaction."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog
from structlog.contextvars import clear_contextvars

from scheduler.infra.settings import Settings
from scheduler.observability.logging import (
    REDACTED,
    accept_request_id,
    bind_request_id,
    bound_job_context,
    configure_logging,
    current_request_id,
    get_logger,
    log_job_finished,
)


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    clear_contextvars()
    stream = io.StringIO()
    configure_logging(Settings(log_level="DEBUG"), stream=stream)
    yield stream
    clear_contextvars()
    structlog.reset_defaults()
    logging.getLogger().handlers.clear()


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_request_id_header_is_kept_when_sane_and_replaced_otherwise() -> None:
    assert accept_request_id("abc-123.x") == "abc-123.x"
    fresh = accept_request_id('evil"\nid')
    assert fresh != 'evil"\nid' and len(fresh) == 32
    assert len(accept_request_id(None)) == 32
    assert len(accept_request_id("x" * 500)) == 32


def test_job_lines_carry_request_and_job_context(log_stream: io.StringIO) -> None:
    bind_request_id("req-1")
    assert current_request_id() == "req-1"
    log = get_logger("worker.test")
    with bound_job_context(job_id="j1", kind="generate", queue="standard", attempt=2, model_version="v3"):
        log.info("job.block", blocks=1)
    log.info("outside")
    first, second = _lines(log_stream)
    assert first["event"] == "job.block"
    assert first["request_id"] == "req-1"
    assert (first["job_id"], first["kind"], first["queue"], first["attempt"]) == (
        "j1",
        "generate",
        "standard",
        2,
    )
    assert first["model_version"] == "v3" and first["level"] == "info" and "timestamp" in first
    assert "job_id" not in second and second["request_id"] == "req-1"


def test_summary_line_has_every_field(log_stream: io.StringIO) -> None:
    log_job_finished(
        get_logger("w"),
        job_id="j9",
        kind="generate",
        queue="interactive",
        status="succeeded",
        attempt=1,
        steps_used=12,
        step_budget=64,
        tokens=40,
        model_version="demo@1",
        wait_seconds=0.123456,
        run_seconds=1.5,
    )
    (line,) = _lines(log_stream)
    assert line["event"] == "job.finished"
    for field in (
        "job_id",
        "kind",
        "queue",
        "attempt",
        "steps_used",
        "step_budget",
        "tokens",
        "model_version",
        "wait_seconds",
        "run_seconds",
    ):
        assert field in line, field
    assert line["wait_seconds"] == 0.1235 and line["tokens"] == 40


def test_payloads_dropped_by_default_and_secrets_always(log_stream: io.StringIO) -> None:
    get_logger("api").info(
        "job.submitted", prompt="my contract text", authorization="Bearer cq_x", kind="generate"
    )
    logging.getLogger("uvicorn.error").info("stdlib line")
    structured, stdlib = _lines(log_stream)
    assert structured["prompt"] == REDACTED
    assert structured["authorization"] == REDACTED
    assert structured["kind"] == "generate"
    assert "my contract text" not in log_stream.getvalue()
    assert stdlib["event"] == "stdlib line" and stdlib["logger"] == "uvicorn.error"


def test_payloads_logged_when_enabled() -> None:
    clear_contextvars()
    stream = io.StringIO()
    configure_logging(Settings(log_payloads=True), stream=stream)
    try:
        get_logger("api").info("job.submitted", prompt="visible", api_key="cq_secret")
        (line,) = _lines(stream)
        assert line["prompt"] == "visible"
        assert line["api_key"] == REDACTED
    finally:
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()
