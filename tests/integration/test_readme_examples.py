"""The README's example job is a real response: the walk-through's request is run through the real
app and a real worker serving the shipped trained demo (what ``cloverq up`` serves), and the
README's JSON must have the same fields, nested the same way, the same ``params`` (issue 33: it
listed ``strategy``/``threshold``, which the API omits when unset) and the same answer, text and
tokens (it showed an earlier demo's answer for a while). On a mismatch the failure prints the real
response formatted for the README."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from scheduler.infra.settings import Settings
from worker.model.demo_trained import TRAINED_CLOVER_DEMO

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
EXAMPLE_CONTRACT = TRAINED_CLOVER_DEMO.parent / "example_contract.txt"
# The walk-through's request (README: "Walk-through: submit, poll"): a question on the example contract.
QUESTION = (f"Contract:\n{EXAMPLE_CONTRACT.read_text()}\n"
            "Question: When must invoices be paid?\nAnswer in one line.")
BODY = {"kind": "generate", "params": {"max_new_tokens": 32},
        "input": {"messages": [{"role": "user", "content": QUESTION}]}}
EXAMPLE_ID = "f3aa3289-b5c9-4a47-93a8-cf4fb6a614a1"


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


def test_the_readme_request_is_the_one_the_test_sends() -> None:
    text = README.read_text()
    match = re.search(r"-d '(\{\"kind\": \"generate\".*?)'\n```", text, re.DOTALL)
    assert match, "README lost the walk-through's POST example"
    assert json.loads(match.group(1)) == BODY


def test_the_readme_job_example_is_what_the_api_answers(
    test_settings: Settings, celery_worker_process: Callable[..., Any], tmp_path: Path
) -> None:
    model_dir = tmp_path / "demo"
    shutil.copytree(TRAINED_CLOVER_DEMO, model_dir)
    settings = test_settings.replaced(auth="disabled", model_dir=model_dir)
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
    assert example["model_version"] == job["model_version"], paste
    answer = ("text", "token_ids", "finish_reason", "usage")
    assert {k: example["result"][k] for k in answer} == {k: job["result"][k] for k in answer}, paste
