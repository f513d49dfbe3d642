"""The README's example job is a real response: the walk-through's request is run through the real
app and a real worker, and the README's JSON must have the same fields, nested the same way, and
the same ``params`` (issue 33: it listed ``strategy``/``threshold``, which the API omits when
unset). On a mismatch the failure prints the real response formatted for the README."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from scheduler.infra.settings import Settings

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
# The walk-through's request (README: "Walk-through: submit, poll").
BODY = {"kind": "generate", "input": {"prompt": "Write a haiku about queues."},
        "params": {"max_new_tokens": 32, "steps_per_block": 4}}
EXAMPLE_ID = "846dba6d-05f5-481e-ab51-d6c9106b77fa"


def readme_job_block(job: dict[str, Any]) -> str:
    """A job as the README shows it: one line per field, a long object one line per member."""
    lines = []
    for key, value in {**job, "id": EXAMPLE_ID}.items():
        inline = json.dumps(value, ensure_ascii=False)
        if isinstance(value, dict) and len(inline) > 96:
            members = ",\n".join(f"    {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}"
                                 for k, v in value.items())
            inline = "{\n" + members + "\n  }"
        lines.append(f"  {json.dumps(key)}: {inline}")
    return "{\n" + ",\n".join(lines) + "\n}"


def shape(value: Any) -> Any:
    """The structure of a JSON value: objects by key, lists and scalars by kind."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return "list"
    if isinstance(value, bool) or value is None:
        return repr(value)
    return "number" if isinstance(value, int | float) else type(value).__name__


def readme_example() -> dict[str, Any]:
    """The JSON block after the walk-through's ``curl -s .../v1/jobs/<id>``."""
    text = README.read_text()
    request = r"curl -s http://127\.0\.0\.1:8000/v1/jobs/" + EXAMPLE_ID + r" [^\n]*\n```\n\n"
    match = re.search(request + r"```json\n(.*?)\n```", text, re.DOTALL)
    assert match, "README lost the walk-through's GET example"
    return dict(json.loads(match.group(1)))


def test_the_readme_job_example_is_what_the_api_answers(
    test_settings: Settings, celery_worker_process: Callable[..., Any]
) -> None:
    settings = test_settings.replaced(auth="disabled")
    celery_worker_process(settings)
    with TestClient(create_app(settings)) as client:
        job_id = client.post("/v1/jobs", json=BODY).json()["id"]
        deadline = time.monotonic() + 60
        job = client.get(f"/v1/jobs/{job_id}", params={"wait": 20}).json()
        while job["status"] in ("queued", "running") and time.monotonic() < deadline:
            job = client.get(f"/v1/jobs/{job_id}", params={"wait": 20}).json()
    assert job["status"] == "succeeded"
    example = readme_example()
    paste = f"README.md's example job is out of date; the real response, to paste:\n{readme_job_block(job)}"
    assert example["params"] == job["params"], paste
    assert shape(example) == shape(job), paste
    assert [example[k] for k in ("kind", "status", "queue")] == [job[k] for k in ("kind", "status", "queue")]
