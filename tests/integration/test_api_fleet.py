"""Three API replicas behind HAProxy (issue 32): any replica serves any request, and one replica
restarted under load (SIGTERM, then started again) costs the clients nothing.

The replicas are real ``cloverq api`` processes sharing only SQL and Redis; HAProxy runs
``deploy/haproxy/haproxy.cfg`` (``tests/integration/api_fleet.py``). Shown here:

- a long poll answers on every replica when the worker finishes the job (each replica has its own
  jobs-finished subscription), and through the balancer;
- an event stream read on one replica resumes on another with ``Last-Event-ID``, after the last
  event received and without repeating one;
- the same ``Idempotency-Key`` sent to two replicas at once makes one job;
- OpenAI streams (the official client) through the balancer, round robin over all replicas;
- a rolling restart of one replica while clients submit, long-poll, follow event streams and read
  OpenAI streams through HAProxy: the replica answers not-ready at once, HAProxy takes it out
  before its listeners close, its long polls answer and its streams end by the drain's deadline
  (the followers resume elsewhere), no answer is a 5xx other than a 503 with ``Retry-After``, no
  request fails in transport, and every accepted job succeeds.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import create_engine, select, text

from client import Client, RetryPolicy
from scheduler.infra.db import session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job
from tests.conftest import ProcessLauncher, clear_leftover_jobs, wait_for
from tests.integration.api_fleet import HAPROXY, NO_HAPROXY, SERVERS, Fleet, Replica, follow

pytestmark = [pytest.mark.integration, pytest.mark.skipif(HAPROXY is None, reason=NO_HAPROXY)]

DRAIN_SECONDS = 2.0  # HAProxy (inter 200 ms, fall 2) takes a draining replica out well within it
FLEET_SETTINGS: dict[str, Any] = {
    "auth": "disabled",  # keys are not what this shows; every replica would accept the same ones
    "rate_limit_per_second": 0,
    "tenant_max_active_jobs": 100_000,
    "api_drain_seconds": DRAIN_SECONDS,
}
FINAL = ("succeeded", "failed", "cancelled")
SHORT = {"max_new_tokens": 4, "steps_per_block": 1, "seed": 1}  # one block
BLOCKS = {"max_new_tokens": 16, "steps_per_block": 2, "seed": 3}  # four blocks: several events


def job_body(params: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"kind": "generate", "input": {"prompt": "The quick brown fox"}, "params": params, **extra}


@pytest.fixture(scope="module")
def fleet(make_settings: Callable[..., Settings], demo_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    settings = make_settings(model_dir=demo_checkpoint, **FLEET_SETTINGS)
    clear_leftover_jobs(settings)
    log_dir = tmp_path_factory.mktemp("fleet")
    launcher = ProcessLauncher(log_dir)
    fleet = Fleet(settings, launcher, [Replica(name) for name in SERVERS])
    try:  # everything starts at once; their start-ups overlap
        worker = launcher.start_worker(settings, wait_ready=False)
        launcher.start_beat(settings)
        for replica in fleet.replicas:
            fleet.start_replica(replica)
        fleet.start_haproxy(log_dir)
        launcher.wait_ready(worker, settings, timeout=120)
        for replica in fleet.replicas:
            fleet.wait_replica(replica)
        fleet.wait_states(dict.fromkeys(SERVERS, "UP"), timeout=10)
        yield fleet
    finally:
        fleet.stop_haproxy()
        launcher.close()


def submit(url: str, params: dict[str, Any], **extra: Any) -> str:
    response = httpx.post(f"{url}/v1/jobs", json=job_body(params, **extra), timeout=30)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def test_long_poll_answers_on_every_replica_and_through_the_balancer(fleet: Fleet) -> None:
    job_id = submit(fleet.lb_url, BLOCKS)
    urls = [*(replica.url for replica in fleet.replicas), fleet.lb_url]
    started = time.monotonic()
    with ThreadPoolExecutor(len(urls)) as pool:
        answers = list(pool.map(lambda url: httpx.get(f"{url}/v1/jobs/{job_id}", params={"wait": 20},
                                                      timeout=30), urls))
    assert [answer.status_code for answer in answers] == [200] * len(urls)
    assert {answer.json()["status"] for answer in answers} == {"succeeded"}
    assert time.monotonic() - started < 15  # answered when the job finished, not at the wait's end


def test_event_stream_resumes_on_another_replica_with_last_event_id(fleet: Fleet) -> None:
    first, second = fleet.replicas[0], fleet.replicas[1]
    job_id = submit(first.url, BLOCKS)
    begun = follow([first.url], job_id, stop_after_blocks=1)  # then this client goes away ...
    assert begun.last_id is not None and begun.result is None
    resumed = follow([second.url], job_id, last_event_id=begun.last_id)  # ... and resumes elsewhere
    result = resumed.result
    assert result is not None and result["status"] == "succeeded"
    # A block is a progress and a delta event under one id: none repeated, in stream order.
    sent = [(event_id, name) for event_id, name, _ in [*begun.events, *resumed.events] if event_id]
    assert len(sent) == len(set(sent)) and [_entry(i) for i, _ in sent] == sorted(_entry(i) for i, _ in sent)
    assert all(_entry(event_id) > _entry(begun.last_id) for event_id, _, _ in resumed.events if event_id)
    # Every event after the resumption point arrived: the text the deltas rebuilt is the stored one's.
    whole = type(begun)(events=[*begun.events, *resumed.events])
    assert result["result"]["text"].startswith(whole.text()) and whole.text()


def _entry(event_id: str) -> tuple[int, int]:
    millis, sequence = event_id.split("-")
    return int(millis), int(sequence)


def test_same_idempotency_key_on_two_replicas_makes_one_job(fleet: Fleet) -> None:
    key = f"fleet-{uuid.uuid4()}"
    urls = [fleet.replicas[0].url, fleet.replicas[1].url, fleet.lb_url]

    def post(url: str) -> httpx.Response:
        headers = {"Idempotency-Key": key}
        return httpx.post(f"{url}/v1/jobs", json=job_body(SHORT), headers=headers, timeout=30)

    with ThreadPoolExecutor(len(urls)) as pool:  # at once: the insert race is the database's to settle
        answers = list(pool.map(post, urls))
    assert sorted(answer.status_code for answer in answers) == [200, 200, 202], [a.text for a in answers]
    assert len({answer.json()["id"] for answer in answers}) == 1
    engine = create_engine(fleet.settings.resolved_database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT count(*) FROM jobs WHERE idempotency_key = :key"), {"key": key})
            assert rows.scalar_one() == 1
    finally:
        engine.dispose()


def test_openai_streams_through_the_balancer_on_every_replica(fleet: Fleet) -> None:
    client = openai.OpenAI(base_url=f"{fleet.lb_url}/v1", api_key="unused", max_retries=0, timeout=30)
    model = client.models.list().data[0].id
    before = fleet.served_counts()
    for _ in SERVERS:  # round robin: one stream per replica at least, with the models call
        stream = client.chat.completions.create(model=model, stream=True, max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "Say hi"}])
        chunks = list(stream)
        assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    after = fleet.served_counts()
    assert all(after[name] > before[name] for name in SERVERS), (before, after)


# --- a rolling restart of one replica under load -------------------------------------------------


@dataclass
class Tally:
    """What the clients saw: every answer's status, and anything a rolling restart must not cause."""

    statuses: Counter[int] = field(default_factory=Counter)
    bad: list[str] = field(default_factory=list)  # a 5xx other than 503 + Retry-After, a transport error
    accepted: list[str] = field(default_factory=list)
    streams: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, response: httpx.Response) -> None:
        with self.lock:
            self.statuses[response.status_code] += 1
            retryable = response.status_code == 503 and "retry-after" in response.headers
            if response.status_code >= 500 and not retryable:
                self.bad.append(f"{response.request.method} {response.request.url.path}: "
                                f"{response.status_code} {response.text[:200]}")

    def guard(self, client: Callable[[threading.Event], None]) -> Callable[[threading.Event], None]:
        def run(stop: threading.Event) -> None:
            while not stop.is_set():
                try:
                    client(stop)
                except Exception as exc:  # a transport error, a broken stream: the test fails on it
                    with self.lock:
                        self.bad.append(repr(exc))
        return run


def _poller(fleet: Fleet, tally: Tally) -> Callable[[threading.Event], None]:
    def once(_stop: threading.Event) -> None:
        with httpx.Client(base_url=fleet.lb_url, timeout=30) as client:
            answer = client.post("/v1/jobs", json=job_body(SHORT))
            tally.record(answer)
            if answer.status_code != 202:
                time.sleep(0.2)
                return
            job_id = answer.json()["id"]
            with tally.lock:
                tally.accepted.append(job_id)
            while True:
                answer = client.get(f"/v1/jobs/{job_id}", params={"wait": 10})
                tally.record(answer)
                if answer.status_code == 200 and answer.json()["status"] in FINAL:
                    return
                time.sleep(0.2 if answer.status_code != 200 else 0)
    return once


def _streamer(fleet: Fleet, tally: Tally) -> Callable[[threading.Event], None]:
    """cloverq's own client library, retries off (an error raises): its stream reconnects with
    ``Last-Event-ID`` when a stopping replica ends it, through HAProxy to another replica."""
    def once(_stop: threading.Event) -> None:
        with Client(fleet.lb_url, retry=RetryPolicy(max_retries=0)) as cq:
            job = cq.submit("The quick brown fox", params=BLOCKS)
            with tally.lock:
                tally.accepted.append(job.id)
            events = list(cq.stream(job.id))
        last = events[-1] if events else None
        assert last is not None and last.event == "result" and last.data["status"] == "succeeded", events[-3:]
        with tally.lock:
            tally.streams += 1
    return once


def _openai_streamer(fleet: Fleet, tally: Tally) -> Callable[[threading.Event], None]:
    body = {"model": fleet.settings.resolved_model_dir.name, "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Say hi"}]}

    def once(_stop: threading.Event) -> None:
        with httpx.stream("POST", f"{fleet.lb_url}/v1/chat/completions", json=body, timeout=30) as response:
            tally.record(response)
            if response.status_code != 200:
                response.read()
                time.sleep(0.2)
                return
            lines = [line for line in response.iter_lines() if line.startswith("data:")]
            assert lines and lines[-1] == "data: [DONE]", lines[-2:]
            with tally.lock:
                tally.streams += 1
    return once


def test_rolling_restart_of_a_replica_under_load_loses_nothing(fleet: Fleet) -> None:
    victim = fleet.replicas[1]
    assert victim.service is not None
    tally = Tally()
    stop = threading.Event()
    clients = [_poller(fleet, tally), _poller(fleet, tally), _streamer(fleet, tally),
               _openai_streamer(fleet, tally)]
    threads = [threading.Thread(target=tally.guard(client), args=(stop,), daemon=True) for client in clients]
    # Held open on the victim itself when SIGTERM comes: a long poll and an event stream of a job that
    # is not due yet (delayed), so neither can end on its own before the drain's deadline.
    waiting_id = submit(fleet.lb_url, SHORT, delay_seconds=2 * DRAIN_SECONDS)
    with ThreadPoolExecutor(2) as probes:
        poll = probes.submit(_timed_get, f"{victim.url}/v1/jobs/{waiting_id}?wait=25")
        stream = probes.submit(follow, [victim.url, fleet.lb_url], waiting_id)
        for thread in threads:
            thread.start()
        time.sleep(1.0)  # clients busy, probes connected
        victim.service.send_sigterm()
        asked = time.monotonic()
        fleet.wait_states({victim.name: "DOWN"}, timeout=DRAIN_SECONDS)
        assert victim.service.proc.poll() is None  # taken out while it still served: nothing refused
        exit_code = victim.service.proc.wait(timeout=DRAIN_SECONDS + 15)
        stopped_after = time.monotonic() - asked
        fleet.start_replica(victim)
        fleet.wait_replica(victim)
        fleet.wait_states(dict.fromkeys(SERVERS, "UP"), timeout=10)
        time.sleep(1.0)  # clients served by the restarted replica too
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        answer, poll_seconds = poll.result(timeout=30)
        followed = stream.result(timeout=60)
    assert exit_code in (0, -signal.SIGTERM), exit_code
    assert DRAIN_SECONDS <= stopped_after < DRAIN_SECONDS + 10
    # The long poll held on the victim answered by the drain's deadline with the status then ...
    assert answer.status_code == 200 and answer.json()["status"] == "queued"
    assert poll_seconds < DRAIN_SECONDS + 5
    # ... its event stream ended with the note, and the follower resumed through HAProxy to the result.
    assert followed.stopping_notes == 1 and followed.connections >= 2
    assert followed.result is not None and followed.result["status"] == "succeeded"
    assert not tally.bad, tally.bad[:10]
    assert all(not thread.is_alive() for thread in threads)
    assert len(tally.accepted) >= 4 and tally.streams >= 2, (tally.statuses, tally.streams)
    rows = _final_rows(fleet, [*tally.accepted, waiting_id])
    assert {job_id: status for job_id, status in rows.items() if status != "succeeded"} == {}
    print(f"rolling restart: replica stopped {stopped_after:.1f}s after SIGTERM; answers "
          f"{dict(tally.statuses)}; {len(tally.accepted)} jobs, {tally.streams} streams")


def _timed_get(url: str) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    answer = httpx.get(url, timeout=40)
    return answer, time.monotonic() - started


def _final_rows(fleet: Fleet, job_ids: list[str]) -> dict[str, str]:
    """Each job's status once all are final (read from SQL)."""
    engine = create_engine(fleet.settings.resolved_database_url)
    wanted = [uuid.UUID(job_id) for job_id in job_ids]

    def statuses() -> dict[str, str] | None:
        with session_factory(engine)() as session:
            found = {str(row.id): str(row.status) for row in session.execute(
                select(Job.id, Job.status).where(Job.id.in_(wanted)))}
        done = len(found) == len(wanted) and all(status in FINAL for status in found.values())
        return found if done else None

    try:
        return dict(wait_for(statuses, timeout=30, interval=0.2, message="every accepted job final"))
    finally:
        engine.dispose()
