"""Decisions end to end on the tiny demo model: API -> queue -> real worker -> result.

Both modes keep ids and order and answer every question with exactly one of its choices;
joint jobs run on the ``joint`` queue; an injected invalid rationale is retried once (metric
counted, alert logged) and a second one fails the job with ``invalid_model_output``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from api.app import create_app
from scheduler.infra.db import get_session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job
from tests.conftest import ProcessLauncher, ServiceProcess, wait_for
from worker.model.tokenizer import Tokenizer
from worker.thinking import split_thinking

pytestmark = pytest.mark.integration

QUESTIONS = [
    {"id": "terminate", "text": "May the supplier terminate early?"},
    {"id": "risk", "text": "How risky is the payment clause?", "choices": ["low", "medium", "high"]},
    {"id": "law", "text": "Which law governs?", "choices": ["english", "german", "french", "none"]},
    {"id": "notice", "text": "Is written notice required?", "choices": ["yes", "no"]},
]
JOINT_CAP = 2
CONTEXT = ("The supplier may terminate this agreement with 30 days written notice. Payment is due "
           "within 90 days of invoice. This agreement is governed by the laws of England.")


@pytest.fixture(scope="module")
def stack(
    make_settings: Callable[..., Settings], demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Settings, TestClient, ServiceProcess]]:
    settings = make_settings(model_dir=demo_checkpoint, auth="disabled", fault_injection=True,
                             engine_max_batch=8, decide_rationale_tokens=12, engine_joint_slot_cap=JOINT_CAP)
    launcher = ProcessLauncher(tmp_path_factory.mktemp("decision-logs"))
    try:
        worker = launcher.start_worker(settings, queues="interactive,standard,bulk,joint", concurrency=8)
        launcher.start_beat(settings)  # the reconciler republishes joint messages the gate handed back
        with TestClient(create_app(settings)) as client:
            yield settings, client, worker
    finally:
        launcher.close()


def _decide(client: TestClient, *, mode: str, rationale: bool = False, params: dict | None = None,
            questions: list[dict] | None = None) -> dict[str, Any]:
    body = {"kind": "decide", "input": {"context": CONTEXT, "questions": questions or QUESTIONS,
                                        "mode": mode, "rationale": rationale},
            "params": {"seed": 3, **(params or {})}}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    return dict(response.json())


def _final(client: TestClient, job_id: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        job = client.get(f"/v1/jobs/{job_id}").json()
        return job if job["status"] not in ("queued", "running") else None

    return wait_for(done, timeout=90, interval=0.1, message=f"decision {job_id}")


def _check_answers(result: dict[str, Any], mode: str, questions: list[dict], rationale: bool) -> None:
    assert result["mode"] == mode
    answers = result["answers"]
    assert [a["id"] for a in answers] == [q["id"] for q in questions]  # ids and order kept, one each
    for answer, question in zip(answers, questions, strict=True):
        assert answer["choice"] in question.get("choices", ["yes", "no"])
        assert 0.0 < answer["confidence"] <= 1.0
        assert ("rationale" in answer) == rationale
        if rationale:
            text = answer["rationale"]
            assert text.strip() and text.isprintable() and '"' not in text and "\\" not in text


@pytest.mark.parametrize("mode", ["independent", "joint"])
@pytest.mark.parametrize("rationale", [False, True])
def test_both_modes_answer_every_question_within_its_choices(stack, mode: str, rationale: bool) -> None:  # type: ignore[no-untyped-def]
    _, client, _ = stack
    submitted = _decide(client, mode=mode, rationale=rationale)
    assert submitted["queue"] == ("joint" if mode == "joint" else submitted["queue"])
    if mode == "joint":
        assert submitted["queue"] == "joint" and submitted["params"]["step_budget"] >= 1
    job = _final(client, submitted["id"])
    assert job["status"] == "succeeded", job
    _check_answers(job["result"], mode, QUESTIONS, rationale)
    assert job["result"]["usage"]["sequences"] == (1 if mode == "joint" else len(QUESTIONS))
    # Progress a user can read: planned blocks are filled (every sequence's, summed), and a
    # finished decision shows all of them done.
    progress = job["progress"]
    assert progress["blocks_total"] is not None
    assert progress["blocks_total"] >= job["result"]["usage"]["sequences"]
    assert progress["blocks_done"] == progress["blocks_total"]


CONSTRAINTS = [{"questions": ["terminate", "notice"], "allowed": [["yes", "yes"], ["no", "no"]]},
               {"questions": ["risk", "law"],
                "allowed": [["low", "english"], ["high", "none"], ["medium", "german"]]}]


def test_a_joint_decisions_answers_always_keep_its_declared_constraints(stack) -> None:  # type: ignore[no-untyped-def]
    """Over HTTP on the random demo (whose lone answers ignore any rule): every answer pair is one
    of its constraint's allowed combinations; independent mode refuses constraints (422)."""
    _, client, _ = stack
    body = {"kind": "decide", "input": {"context": CONTEXT, "questions": QUESTIONS, "mode": "joint",
                                        "constraints": CONSTRAINTS}}
    ids = [client.post("/v1/jobs", json={**body, "params": {"seed": seed}}).json()["id"] for seed in range(4)]
    for job_id in ids:
        job = _final(client, job_id)
        assert job["status"] == "succeeded", job
        choice = {a["id"]: a["choice"] for a in job["result"]["answers"]}
        for constraint in CONSTRAINTS:
            assert [choice[q] for q in constraint["questions"]] in constraint["allowed"]
    refused = client.post("/v1/jobs", json={**body, "input": {**body["input"], "mode": "independent"}})
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "invalid_request"
    assert 'need mode "joint"' in refused.json()["error"]["details"][0]["message"]


def _invalid_output_count(client: TestClient) -> float:
    """``cloverq_invalid_output_retries_total{kind="decide"}`` as ``/metrics`` exports it."""
    text = client.get("/metrics").text
    for line in text.splitlines():
        if line.startswith("cloverq_invalid_output_retries_total{") and 'kind="decide"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_invalid_rationale_is_retried_once_then_succeeds(stack) -> None:  # type: ignore[no-untyped-def]
    _, client, worker = stack
    before = _invalid_output_count(client)
    submitted = _decide(client, mode="joint", rationale=True, params={"fault": "invalid_rationale_once"})
    job = _final(client, submitted["id"])
    assert job["status"] == "succeeded", job
    _check_answers(job["result"], "joint", QUESTIONS, rationale=True)
    assert job["result"]["usage"]["attempts"] == 2 and job["attempt"] == 1  # retried inside the attempt
    assert _invalid_output_count(client) == before + 1
    assert "decision.invalid_model_output" in worker.log()


def test_second_invalid_rationale_fails_with_invalid_model_output(stack) -> None:  # type: ignore[no-untyped-def]
    _, client, _ = stack
    before = _invalid_output_count(client)
    submitted = _decide(client, mode="independent", rationale=True,
                        params={"fault": "invalid_rationale_always"}, questions=QUESTIONS[:2])
    job = _final(client, submitted["id"])
    assert job["status"] == "failed"
    assert job["error"]["code"] == "invalid_model_output"
    assert job["result"] is None and job["attempt"] == 1  # not retried as a transient fault
    assert _invalid_output_count(client) == before + 2


def test_joint_backlog_never_holds_more_than_its_cap_and_short_jobs_pass(stack) -> None:  # type: ignore[no-untyped-def]
    settings, client, _ = stack
    many = [{"id": f"q{i}", "text": f"Is clause {i} binding?"} for i in range(24)]
    joint = [_decide(client, mode="joint", questions=many, params={"seed": i})["id"] for i in range(6)]
    short = []
    for i in range(3):
        response = client.post("/v1/jobs", json={"kind": "generate", "input": {"prompt": f"hi {i}"},
                                                 "params": {"max_new_tokens": 4}})
        short.append(response.json()["id"])
    sessions = get_session_factory(settings.resolved_database_url)
    peak = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with sessions() as session:
            rows = dict(session.execute(select(Job.id, Job.status).where(
                Job.id.in_([uuid.UUID(j) for j in joint + short]))).all())
        running_joint = sum(rows[uuid.UUID(j)] == "running" for j in joint)
        peak = max(peak, running_joint)
        if all(rows[uuid.UUID(j)] == "succeeded" for j in joint + short):
            break
        time.sleep(0.05)
    assert peak <= JOINT_CAP
    jobs = {j: client.get(f"/v1/jobs/{j}").json() for j in joint + short}
    assert all(job["status"] == "succeeded" for job in jobs.values())
    last_joint_start = max(jobs[j]["timings"]["started_at"] for j in joint)
    assert all(jobs[j]["timings"]["finished_at"] < last_joint_start for j in short)  # short work passed


def test_thinking_generate_returns_reasoning_and_text(stack) -> None:  # type: ignore[no-untyped-def]
    settings, client, _ = stack
    response = client.post("/v1/jobs", json={
        "kind": "generate", "input": {"messages": [{"role": "user", "content": "Think, then answer."}]},
        "params": {"thinking": True, "max_new_tokens": 16, "seed": 1},
    })
    assert response.status_code == 202, response.text
    submitted = response.json()
    assert submitted["params"]["thinking"] is True
    assert submitted["params"]["step_budget"] == settings.thinking.default_step_budget  # larger default
    job = _final(client, submitted["id"])
    assert job["status"] == "succeeded", job
    result = job["result"]
    tokenizer = Tokenizer.from_dir(settings.model.dir)
    expected = split_thinking(result["token_ids"], think_start_id=tokenizer.think_start_id,
                              think_end_id=tokenizer.think_end_id,
                              decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True))
    assert (result["reasoning"], result["text"]) == (expected.reasoning, expected.text)
    if tokenizer.think_end_id not in result["token_ids"]:  # never closed its thinking: no answer yet
        assert result["text"] == ""
