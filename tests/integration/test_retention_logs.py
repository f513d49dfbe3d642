"""Logs never hold a job's input or output (docs/security.md#retention, issue 27 part 3).

An API (in this process, its structured logs captured), a real worker and the beat process (their
log files), all at DEBUG and with the default ``log_payloads=False``, run a job with a distinctive
prompt end to end: submit, long poll, the event stream, the result, and the beat's purge tick once
its retention (0 s) passed. Neither the prompt nor the output text may appear in any log line.
"""

from __future__ import annotations

import io
import json
import logging
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from fastapi.testclient import TestClient
from structlog.contextvars import clear_contextvars

from api.app import create_app
from scheduler.infra.settings import Settings
from scheduler.observability.logging import configure_logging
from tests.conftest import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def captured_logs() -> Iterator[Callable[[Settings], io.StringIO]]:
    """This process' structured logs into a buffer (reset afterwards)."""

    def capture(settings: Settings) -> io.StringIO:
        stream = io.StringIO()
        configure_logging(settings, stream=stream)
        return stream

    clear_contextvars()
    yield capture
    clear_contextvars()
    structlog.reset_defaults()
    logging.getLogger().handlers.clear()


def test_no_log_line_of_the_api_worker_or_beat_holds_the_prompt_or_the_output(
    make_settings: Callable[..., Settings], demo_checkpoint: Path, celery_worker_process: Callable[..., Any],
    beat_process: Callable[..., Any], captured_logs: Callable[[Settings], io.StringIO],
) -> None:
    settings = make_settings(model_dir=demo_checkpoint, auth="disabled", log_level="DEBUG",
                             purge_interval_seconds=0.5)
    assert settings.observability.log_payloads is False  # the default under test
    api_log = captured_logs(settings)
    secret = f"Confidential clause {uuid.uuid4().hex} of the merger"
    with TestClient(create_app(settings)) as client:
        worker = celery_worker_process(settings)
        body = {"kind": "generate", "input": {"messages": [{"role": "user", "content": secret}]},
                "params": {"max_new_tokens": 24, "block_size": 4, "steps_per_block": 2, "seed": 11},
                "retention_seconds": 0}
        job_id = client.post("/v1/jobs", json=body).json()["id"]
        job = client.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()
        assert job["status"] == "succeeded", job
        output = job["result"]["text"]
        assert client.get(f"/v1/jobs/{job_id}/events").status_code == 200
        beat = beat_process(settings)  # its purge tick: SETTLE_SECONDS after the finish at the earliest
        purged = wait_for(lambda: client.get(f"/v1/jobs/{job_id}").json()["purged_at"], timeout=30,
                          interval=0.5, message="the beat purged the job")
        assert purged and client.get(f"/v1/jobs/{job_id}").json()["result"] is None
    # the beat's tick did it: it logs after its purge commits, and the child's output reaches its
    # log file a moment later, so wait for the line rather than read the log at the commit's instant
    wait_for(lambda: any("retention.purged" in line for line in beat.log().splitlines()), timeout=10,
             interval=0.2, message="the beat's tick to log the purge")
    lines = api_log.getvalue().splitlines() + worker.log().splitlines() + beat.log().splitlines()
    assert any(job_id in line for line in lines)  # the logs were captured (and name the job)
    assert [line for line in lines if secret in line] == []
    if len(output.strip()) >= 8:  # a text that short could occur by chance
        forms = {output, json.dumps(output)[1:-1]}  # as is, and as a JSON line escapes it
        assert [line for line in lines if any(form in line for form in forms)] == []
