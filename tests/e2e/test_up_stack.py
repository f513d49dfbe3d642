"""``cloverq up`` end to end: start it like the README does, drive it over HTTP, stop it.

The stack runs in a fresh temp dir with its defaults (SQLite, the embedded redis-server, the
demo checkpoint, API + worker + beat), on free ports, with the API's planes split
(``--admin-port``/``--ops-port``; the dashboard's browser test runs ``up`` in one-port mode).
Checks: each plane on its own port only, submit -> poll -> succeeded with generated tokens,
decisions (a 16K-token contract too), `cloverq model eval` against the engine in-process, cancel,
client mistakes as 4xx JSON, then SIGTERM and every process ``up`` started is gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from bench.demo_quality import decision_report, served_joint_decode, started_engine, tool_call_report
from bench.fleet_services import free_port
from tests.long_contract import QUESTIONS, contract
from worker.model.checkpoint import load_checkpoint
from worker.model.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e

STARTUP_TIMEOUT = 180.0
JOB_TIMEOUT = 90.0
LONG_CONTRACT_TOKENS = 16_000  # with its questions within `up`'s default 16,384-token prompt cap


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) for every live process (Linux /proc)."""
    table: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        table[int(entry.name)] = (int(fields[1]), fields[0])
    return table


def _descendants(root: int) -> set[int]:
    table = _proc_table()
    found: set[int] = set()
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _) in table.items() if ppid == parent and pid not in found]
        found.update(children)
        frontier.extend(children)
    return found


def _alive(pid: int) -> bool:
    state = _proc_table().get(pid)
    return state is not None and state[1] not in ("Z", "X")


@dataclass
class Stack:
    process: subprocess.Popen[bytes]
    base_url: str
    admin_url: str
    ops_url: str
    api_key: str
    output: Path

    def text(self) -> str:
        return self.output.read_text(errors="replace")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("up")
    port, admin_port, ops_port = free_port(), free_port(), free_port()
    env = {name: value for name, value in os.environ.items() if not name.startswith("CLOVERQ_")}
    env.update({"CLOVERQ_EMBEDDED_REDIS_PORT": str(free_port()), "CLOVERQ_LOG_LEVEL": "WARNING",
                "PYTHONUNBUFFERED": "1"})
    output = workdir / "up.out"
    with output.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "cli", "up", "--port", str(port), "--admin-port", str(admin_port),
             "--ops-port", str(ops_port)],
            cwd=workdir, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )
    deadline = time.monotonic() + STARTUP_TIMEOUT
    key_match = None
    while time.monotonic() < deadline:
        text = output.read_text(errors="replace")
        key_match = re.search(r"dev API key \(tenant 'default'\): (\S+)", text)
        if key_match and "cloverq is up" in text:
            break
        if process.poll() is not None:
            pytest.fail(f"cloverq up exited with {process.returncode}:\n{text[-4000:]}")
        time.sleep(0.2)
    else:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"cloverq up was not ready in {STARTUP_TIMEOUT}s:\n{output.read_text()[-4000:]}")
    assert key_match is not None
    assert (workdir / ".cloverq" / "cloverq.db").is_file()  # state under ./.cloverq by default
    yield Stack(process=process, base_url=f"http://127.0.0.1:{port}", admin_url=f"http://127.0.0.1:{admin_port}",
                ops_url=f"http://127.0.0.1:{ops_port}", api_key=key_match.group(1), output=output)
    if process.poll() is None:  # the last test stops it; this is only the safety net
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


@pytest.fixture
def client(stack: Stack) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    with httpx.Client(base_url=stack.base_url, headers=headers, timeout=10.0) as http:
        yield http


def _wait_status(client: httpx.Client, job_id: str, statuses: set[str]) -> dict[str, object]:
    deadline = time.monotonic() + JOB_TIMEOUT
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in statuses:
            return job
        time.sleep(0.1)
    pytest.fail(f"job {job_id} did not reach {statuses}: {job}")


def test_ready_and_documented(client: httpx.Client, stack: Stack) -> None:
    assert client.get(f"{stack.ops_url}/livez").json() == {"status": "ok"}
    ready = client.get(f"{stack.ops_url}/readyz")
    assert ready.status_code == 200, ready.text
    assert client.get("/docs").status_code == 200
    assert f"planes: public {stack.base_url}   admin {stack.admin_url}   ops {stack.ops_url}" in stack.text()


def test_each_plane_answers_on_its_own_port_only(client: httpx.Client, stack: Stack) -> None:
    """The dev key is an admin key: on the public port the admin paths are still 404."""
    for path in ("/v1/admin/overview", "/dashboard", "/metrics", "/readyz", "/livez"):
        assert client.get(path).status_code == 404, path
    overview = client.get(f"{stack.admin_url}/v1/admin/overview")
    assert overview.status_code == 200, overview.text
    assert client.get(f"{stack.admin_url}/v1/jobs").status_code == 404
    assert "cloverq_jobs_submitted_total" in client.get(f"{stack.ops_url}/metrics").text
    assert client.get(f"{stack.ops_url}/v1/admin/overview").status_code == 404


def test_submit_poll_succeeded_with_generated_tokens(client: httpx.Client) -> None:
    body = {"kind": "generate", "input": {"prompt": "Once upon a time"}, "params": {"max_new_tokens": 16}}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    assert response.headers["Location"].endswith(response.json()["id"])
    job = _wait_status(client, response.json()["id"], {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded", job
    result = job["result"]
    assert isinstance(result, dict)
    assert 0 < len(result["token_ids"]) <= 16
    assert isinstance(result["text"], str)
    assert result["finish_reason"] in {"eos", "length", "budget"}
    assert job["model_version"]


def test_clover_demo_answers_thinking_and_both_decision_modes(client: httpx.Client) -> None:
    """`cloverq up` serves the Clover demo: thinking generation and independent + joint decisions."""
    messages = [{"role": "user", "content": "Why is grass green?"}]
    params = {"thinking": True, "max_new_tokens": 24}
    thinking = {"kind": "generate", "input": {"messages": messages}, "params": params}
    questions = [
        {"id": "terminate", "text": "May the supplier terminate early?"},
        {"id": "risk", "text": "Risk level?", "choices": ["low", "medium", "high"]},
    ]
    context = "The supplier may terminate with 30 days notice."
    bodies = [thinking] + [
        {"kind": "decide", "input": {"context": context, "questions": questions, "mode": mode}}
        for mode in ("independent", "joint")
    ]
    ids = []
    for body in bodies:
        response = client.post("/v1/jobs", json=body)
        assert response.status_code == 202, response.text
        ids.append(response.json()["id"])
    jobs = [_wait_status(client, job_id, {"succeeded", "failed", "cancelled"}) for job_id in ids]
    assert all(job["status"] == "succeeded" for job in jobs), jobs
    assert {"reasoning", "text"} <= set(jobs[0]["result"])  # type: ignore[arg-type]
    for job, mode in zip(jobs[1:], ("independent", "joint"), strict=True):
        result = job["result"]
        assert isinstance(result, dict) and result["mode"] == mode
        answers = result["answers"]
        assert [a["id"] for a in answers] == ["terminate", "risk"]
        assert answers[0]["choice"] in {"yes", "no"} and answers[1]["choice"] in {"low", "medium", "high"}
        assert all(0.0 <= a["confidence"] <= 1.0 for a in answers)


def test_a_16k_token_contract_is_decided_in_both_modes(client: httpx.Client, stack: Stack) -> None:
    """Issue 26: a contract of about 16K tokens (within the default 16,384-token prompt cap) decided
    through `cloverq up`'s defaults (chunked prefill, the prefix cache, the planner's memory), one
    decision per mode; both succeed with an answer per question."""
    tokenizer = Tokenizer.from_dir(stack.output.parent / ".cloverq" / "models" / "demo")  # what `up` serves
    text = contract(lambda part: len(tokenizer.encode(part)), LONG_CONTRACT_TOKENS)
    ids = []
    for mode in ("independent", "joint"):
        body = {"kind": "decide", "input": {"context": text, "questions": QUESTIONS, "mode": mode}}
        response = client.post("/v1/jobs", json=body)
        assert response.status_code == 202, response.text
        ids.append(response.json()["id"])
    for job_id, mode in zip(ids, ("independent", "joint"), strict=True):
        job = _wait_status(client, job_id, {"succeeded", "failed", "cancelled"})
        assert job["status"] == "succeeded", job
        result = job["result"]
        assert isinstance(result, dict) and result["mode"] == mode
        answers = result["answers"]
        assert [a["id"] for a in answers] == [q["id"] for q in QUESTIONS]
        assert all(a["choice"] in {"yes", "no"} and 0.0 <= a["confidence"] <= 1.0 for a in answers), answers
        progress = job["progress"]
        assert isinstance(progress, dict) and progress["prompt_tokens"] >= LONG_CONTRACT_TOKENS, progress


def test_cancel(client: httpx.Client, stack: Stack) -> None:
    """The trained demo answers "A long story" in a block or two, faster than a cancel arrives, so
    the job is held in its drained queue (the dev key is an admin key) and cancelled there."""
    body = {"kind": "generate", "input": {"prompt": "A long story"},
            "params": {"max_new_tokens": 1024, "steps_per_block": 16}}
    admin = f"{stack.admin_url}/v1/admin/queues/standard"
    assert client.post(f"{admin}/drain").status_code == 200
    try:
        submitted = client.post("/v1/jobs", json=body).json()
        assert submitted["queue"] == "standard", submitted
        response = client.post(f"/v1/jobs/{submitted['id']}/cancel")
        assert response.status_code == 200
    finally:
        assert client.post(f"{admin}/resume").status_code == 200
    job = _wait_status(client, submitted["id"], {"cancelled", "succeeded", "failed"})
    assert job["status"] == "cancelled", job
    assert job["result"] is None


def test_client_mistakes_are_4xx_json(client: httpx.Client, stack: Stack) -> None:
    body = {"kind": "generate", "input": {"prompt": "x"}, "params": {"bogus": 1}}
    invalid = client.post("/v1/jobs", json=body)
    assert invalid.status_code == 422
    assert invalid.json()["error"]["code"] == "invalid_request"
    missing = client.get("/v1/jobs/00000000-0000-0000-0000-000000000000")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "job_not_found"
    anonymous = httpx.post(f"{stack.base_url}/v1/jobs", json={"kind": "generate", "input": {"prompt": "x"}})
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "unauthorized"


def test_model_eval_runs_its_suites_as_jobs_and_agrees_with_the_engine_in_process(
    stack: Stack, tmp_path: Path
) -> None:
    """`cloverq model eval` (README "Quality") submits a suite's cases as jobs to the running
    stack; its figures must be what `bench.demo_quality` gets for the same cases on the same
    checkpoint in-process (the same handlers on an engine of its own), case for case."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("CLOVERQ_")}
    env.update({"CLOVERQ_API_URL": stack.base_url, "CLOVERQ_API_KEY": stack.api_key})
    reports = {}
    for suite in ("decisions", "tools"):
        path = tmp_path / f"{suite}.json"
        run = subprocess.run(
            [sys.executable, "-m", "cli", "model", "eval", "--suite", suite, "--count", "3",
             "--report", str(path)],
            cwd=stack.output.parent, env=env, capture_output=True, timeout=300,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr.decode(errors="replace")[-3000:]
        reports[suite] = json.loads(path.read_text())
        assert reports[suite]["suite"] == suite and reports[suite]["seed"] == 1
    lm = load_checkpoint(stack.output.parent / ".cloverq" / "models" / "demo", dtype=torch.float32)
    engine = started_engine(lm)
    try:
        for split in ("eval", "heldout"):
            local = decision_report(engine, lm.tokenizer, split, 1, 3,
                                    joint_one_pass=served_joint_decode(lm) == "one_pass")  # as the worker
            for mode in ("independent", "joint"):
                served, alone = reports["decisions"][split][mode], local[mode]
                assert isinstance(alone, dict) and served["jobs"] == 3 and served["failed_jobs"] == 0
                assert served == {k: v for k, v in alone.items() if k in served}, (split, mode)
            served_tools = reports["tools"][split]
            assert served_tools["jobs"] == 3 and served_tools["failed_jobs"] == 0
            assert served_tools == tool_call_report(engine, lm.tokenizer, split, 1, 3), split
    finally:
        engine.stop()


def test_sigterm_stops_every_child(stack: Stack) -> None:
    children = _descendants(stack.process.pid)
    assert len(children) >= 4, stack.text()  # redis-server, worker, beat, api (and theirs)
    stack.process.send_signal(signal.SIGTERM)
    assert stack.process.wait(timeout=120) == 0, stack.text()[-4000:]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in children):
        time.sleep(0.1)
    assert [pid for pid in children if _alive(pid)] == [], stack.text()[-4000:]
