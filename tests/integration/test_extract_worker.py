"""``extract`` jobs end to end: a running stack (API over HTTP, a real Celery worker, the
session's database and Redis) on the tiny Clover and SDAR demos. The Python client's
``extract``, a batch of extract jobs (JSON and JSONL), the ``cloverq extract`` CLI, and a
schema outside the subset (400, nothing stored); every value is judged by ``jsonschema``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from click.testing import CliRunner, Result

from client import Client, Job
from scheduler.access.api_keys import create_key
from scheduler.infra.db import make_engine, session_factory
from scheduler.infra.settings import Settings, get_settings
from tests.conftest import ProcessLauncher, clear_leftover_jobs
from tests.integration.api_server import ApiServer

pytestmark = pytest.mark.integration

TENANT = "extract-tests"
QUICK = {"block_size": 4, "steps_per_block": 2, "temperature": 0.7}
CONTRACT = ("SUPPLY AGREEMENT between Acme Corp (Seller) and Bolt Ltd (Buyer). The Buyer pays 1200 dollars "
            "per month; either party may terminate with 30 days' notice. Governed by Delaware law.")
PARTIES = {"type": "object", "properties": {"seller": {"type": "string", "maxLength": 12},
                                            "buyer": {"type": "string", "maxLength": 12}},
           "required": ["seller", "buyer"], "additionalProperties": False}
TERMS = {"type": "object", "properties": {
    "monthly_fee": {"type": "integer", "minimum": 0, "maximum": 100000},
    "notice_days": {"type": "integer", "minimum": 1, "maximum": 90},
    "law": {"enum": ["NY", "DE", "CA"]},
    "renews": {"type": "boolean"},
}, "required": ["monthly_fee", "notice_days", "law"]}


@dataclass
class Stack:
    family: str
    url: str
    key: str

    def client(self) -> Client:
        return Client(self.url, self.key, timeout=60.0)


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, make_settings: Callable[..., Settings],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """API + worker on the family named by the test (indirect parametrization)."""
    family: str = request.param
    checkpoint: Path = request.getfixturevalue("demo_checkpoint" if family == "clover" else "sdar_checkpoint")
    settings = make_settings(model_dir=checkpoint, fault_injection=False)
    engine = make_engine(settings.resolved_database_url)
    with session_factory(engine)() as session:
        key = create_key(session, tenant=TENANT, scopes={"submit", "read"}, label=f"extract-{family}").key
    engine.dispose()
    clear_leftover_jobs(settings)  # the worker must see this module's jobs only
    launcher = ProcessLauncher(tmp_path_factory.mktemp(f"extract-{family}"))
    server = ApiServer(settings).start()
    try:
        launcher.start_worker(settings)
        yield Stack(family=family, url=server.url, key=key)
    finally:
        launcher.close()
        server.stop()


def _valid(job: Job, schema: dict[str, Any]) -> Any:
    assert job.status == "succeeded", job.error
    assert job.kind == "extract" and job.result is not None
    jsonschema.validate(job.data, schema)
    assert json.loads(job.result.text or "") == job.data
    return job.data


@pytest.mark.parametrize("stack", ["clover", "sdar"], indirect=True)
def test_the_client_extracts_values_valid_against_each_schema(stack: Stack) -> None:
    with stack.client() as cq:
        jobs = [cq.extract(CONTRACT, schema, instructions="Read the contract.", params=QUICK, seed=i)
                for i, schema in enumerate((PARTIES, TERMS))]
        parties, terms = (cq.wait(job.id, timeout=60) for job in jobs)
    _valid(parties, PARTIES)
    _valid(terms, TERMS)
    assert terms.result is not None and terms.result.confidence is not None
    assert 0.0 < terms.result.confidence["/law"] <= 1.0  # a choice field's probability, by JSON pointer
    assert terms.params is not None and "max_new_tokens" not in terms.params  # the canvas sets the length


@pytest.mark.parametrize("stack", ["clover"], indirect=True)
def test_a_batch_of_extract_jobs_as_json_and_jsonl(stack: Stack) -> None:
    specs = [{"kind": "extract", "input": {"context": CONTRACT, "schema": schema}, "params": QUICK,
              "metadata": {"n": i}} for i, schema in enumerate((PARTIES, TERMS, PARTIES))]
    jsonl = "\n".join(json.dumps(spec) for spec in specs[:2]) + "\n"
    with stack.client() as cq:
        # one after the other: more bulk jobs than the worker's class cap (engine_max_batch, 4 here)
        # are handed back for the reconciler, and this stack runs no beat
        for submit in (lambda: cq.create_batch(specs), lambda: cq.upload_batch(jsonl)):
            batch = submit()
            assert cq.wait_batch(batch.id, timeout=60, poll_interval=0.2).counts == {"succeeded": batch.total}
            lines = list(cq.batch_results(batch.id))
            assert [line["index"] for line in lines] == list(range(batch.total))
            for line, spec in zip(lines, specs, strict=False):
                assert line["metadata"] == spec["metadata"]
                jsonschema.validate(line["result"]["data"], spec["input"]["schema"])


@pytest.mark.parametrize("stack", ["clover"], indirect=True)
def test_a_schema_outside_the_subset_is_a_400_and_nothing_is_stored(stack: Stack) -> None:
    label = f"refused-{time.monotonic_ns()}"
    auth = {"Authorization": f"Bearer {stack.key}"}
    response = httpx.post(f"{stack.url}/v1/jobs", headers=auth, json={
        "kind": "extract", "metadata": {"probe": label},
        "input": {"context": CONTRACT, "schema": {"type": "object", "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]+$"}}}}})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "unsupported_schema_keyword"
    assert error["details"][0]["loc"] == ["body", "input", "schema"]
    assert error["details"][0]["path"] == "#/properties/code/pattern"
    missing = httpx.post(f"{stack.url}/v1/jobs", headers=auth,
                         json={"kind": "extract", "metadata": {"probe": label}, "input": {"schema": PARTIES}})
    assert missing.status_code == 422 and missing.json()["error"]["code"] == "invalid_request"
    listed = httpx.get(f"{stack.url}/v1/jobs", params={"limit": 200}, headers=auth).json()["items"]
    assert [j for j in listed if (j.get("metadata") or {}).get("probe") == label] == []


def _cli(stack: Stack, *args: str, input_text: str | None = None) -> Result:
    from cli.main import cli

    get_settings.cache_clear()  # the CLI reads CLOVERQ_API_URL / CLOVERQ_API_KEY through the settings
    try:
        return CliRunner().invoke(cli, list(args), input=input_text,
                                  env={"CLOVERQ_API_URL": stack.url, "CLOVERQ_API_KEY": stack.key})
    finally:
        get_settings.cache_clear()


@pytest.mark.parametrize("stack", ["clover"], indirect=True)
def test_the_cli_extracts_from_stdin_and_says_what_is_wrong(stack: Stack, tmp_path: Path) -> None:
    schema_file = tmp_path / "terms.json"
    schema_file.write_text(json.dumps(TERMS))
    quick = ["--block-size", "4", "--steps-per-block", "2"]
    value = _cli(stack, "extract", "--context-file", "-", "--schema-file", str(schema_file), *quick,
                 "--wait", "--data", input_text=CONTRACT)
    assert value.exit_code == 0, value.output
    jsonschema.validate(json.loads(value.stdout), TERMS)

    job = _cli(stack, "extract", "--context", CONTRACT, "--schema", json.dumps(PARTIES),
               "--instructions", "Name the parties.", *quick, "--wait")
    assert job.exit_code == 0, job.output
    jsonschema.validate(json.loads(job.stdout)["result"]["data"], PARTIES)

    schema_file.write_text('{"type": "object",')
    broken = _cli(stack, "extract", "--context", CONTRACT, "--schema-file", str(schema_file))
    assert broken.exit_code == 2 and "is not JSON" in broken.output and "line 1" in broken.output
    both = _cli(stack, "extract", "--schema", "{}")
    assert both.exit_code == 2 and "--context or --context-file" in both.output
    refused = _cli(stack, "extract", "--context", CONTRACT, "--schema", '{"type": "string", "pattern": "a"}')
    assert refused.exit_code == 1 and "unsupported_schema_keyword (HTTP 400)" in refused.output
