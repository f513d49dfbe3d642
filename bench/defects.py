"""The fault-and-load run of issue 31, after the fixes: ``python -m bench.defects``.

A real stack on loopback (two API processes, two workers on all four queues, one beat; PostgreSQL
when ``--database-url`` names one, else SQLite; the given Redis or an embedded one) and three
checks, each printed with the figure the issue asks for:

1. **Stranded messages.** Drain ``bulk``, submit a batch of ``--dead`` jobs, cancel it, resume
   ``bulk``, then run ``--live`` short bulk jobs while a few long ones keep the engines busy (the
   capacity gates churn on the dead messages): every live job must finish, each worker's Celery
   consumer must be on all four queues afterwards, and the dead messages must be gone from the
   lists (purged by the reconciler or skipped) and never have counted against the depth cap.
2. **Idle connections.** ``--idle`` idle TCP connections to one API process (its cap lowered with
   ``--max-connections``): how many were refused at connect with 503, whether ``/healthz``
   answered 5 of 5 while they were held, and how many the server closed after its idle timeout.
3. **Event streams.** ``--streams`` sampled jobs followed through ``GET /v1/jobs/{id}/events``,
   alternately on the two API processes: the share whose deltas add up to the stored text.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.backends import HOST, free_port, scratch_database, scratch_redis
from bench.mix import Worker, _start_beat, _start_worker, _wait_ready
from scheduler.access.api_keys import create_key
from scheduler.infra import redis_keys
from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.db import migrate
from scheduler.infra.settings import Settings

ALL_QUEUES = {"interactive", "standard", "bulk", "joint"}
SHORT = {"max_new_tokens": 4, "block_size": 4, "steps_per_block": 1}
LONG = {"max_new_tokens": 1024, "temperature": 1.0, "top_p": 0.95}
STORY = {"max_new_tokens": 96, "block_size": 4, "steps_per_block": 2, "temperature": 1.0, "top_p": 0.9}


def _start_api(settings: Settings, workdir: Path, name: str) -> tuple[Worker, str]:
    port = free_port()
    env = {**os.environ, **settings.to_env(), "PYTHONUNBUFFERED": "1"}
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "api", "--host", HOST, "--port", str(port)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return Worker(name, proc, log_path), url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{name} did not start")


def _batch(client: httpx.Client, params: dict[str, Any], n: int, tag: str) -> str:
    jobs = [{"kind": "generate", "input": {"prompt": f"{tag} {i}"}, "params": {**params, "seed": i}}
            for i in range(n)]
    response = client.post("/v1/batches", json={"jobs": jobs}, timeout=120)
    response.raise_for_status()
    return str(response.json()["id"])


def _consumers(settings: Settings, nodes: list[str]) -> dict[str, set[str]]:
    answer = create_celery_app(settings).control.inspect(destination=nodes, timeout=3.0).active_queues() or {}
    return {node: {queue["name"] for queue in answer.get(node, [])} for node in nodes}


def stranded(settings: Settings, client: httpx.Client, nodes: list[str], args: argparse.Namespace) -> dict:
    r = redis.Redis.from_url(settings.resolved_redis_url)
    assert client.post("/v1/admin/queues/bulk/drain").status_code == 200
    dead = _batch(client, SHORT, args.dead, "Dead")
    client.post(f"/v1/batches/{dead}/cancel").raise_for_status()
    listed = sum(int(r.llen(f"bulk{suffix}")) for suffix in ("", "\x06\x163", "\x06\x166", "\x06\x169"))
    dead_counted = int(r.zcard(redis_keys.dead_messages("bulk")))
    queues = {q["name"]: q["depth"] for q in client.get("/v1/admin/queues").json()["items"]}
    assert client.post("/v1/admin/queues/bulk/resume").status_code == 200
    long = _batch(client, LONG, 2 * len(nodes), "Long")
    started = time.monotonic()
    live = _batch(client, SHORT, args.live, "Live")
    while client.get(f"/v1/batches/{live}").json()["status"] != "completed":
        if time.monotonic() - started > args.timeout:
            break
        time.sleep(0.5)
    finished_s = time.monotonic() - started
    counts = client.get(f"/v1/batches/{live}").json()["counts"]
    client.post(f"/v1/batches/{long}/cancel")
    time.sleep(3.0)  # a heartbeat or two: the gates free, consumers are back
    consumers = _consumers(settings, nodes)
    left = sum(int(r.llen(f"bulk{suffix}")) for suffix in ("", "\x06\x163", "\x06\x166", "\x06\x169"))
    return {"dead_jobs": args.dead, "dead_messages_listed_after_cancel": listed,
            "dead_counted_in_dead_set": dead_counted, "bulk_depth_reported_after_cancel": queues.get("bulk"),
            "live_jobs": args.live, "live_counts": counts, "live_seconds": round(finished_s, 1),
            "stranded_live_jobs": args.live - counts.get("succeeded", 0) - counts.get("failed", 0),
            "bulk_messages_left": left, "dead_set_left": int(r.zcard(redis_keys.dead_messages("bulk"))),
            "workers_on_all_queues": sum(1 for q in consumers.values() if q == ALL_QUEUES),
            "workers": len(nodes)}


def idle_connections(url: str, args: argparse.Namespace) -> dict:
    port = int(url.rsplit(":", 1)[1])
    held: list[socket.socket] = []
    refused = 0
    try:
        for _ in range(args.idle):
            sock = socket.create_connection((HOST, port), timeout=5)
            held.append(sock)
        time.sleep(1.0)
        for sock in held:  # a refused connection was answered 503 at once
            sock.setblocking(False)
            try:
                data = sock.recv(64)
                refused += data.startswith(b"HTTP/1.1 503")
            except BlockingIOError:
                pass
            sock.setblocking(True)
        health = sum(1 for _ in range(5) if _healthz(url))
        time.sleep(args.idle_timeout + 2.0)
        closed = sum(1 for sock in held if _closed_by_peer(sock))
    finally:
        for sock in held:
            sock.close()
    return {"idle_connections": args.idle, "refused_at_connect_503": refused, "healthz_ok_of_5": health,
            "closed_by_server_after_idle_timeout": closed}


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (EOF after whatever it said), without waiting long."""
    sock.settimeout(0.05)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


def _healthz(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def streams(urls: list[str], key: str, args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {key}"}

    def follow(i: int) -> bool:
        with httpx.Client(base_url=urls[i % len(urls)], headers=headers, timeout=120) as client:
            job = client.post("/v1/jobs", json={"kind": "generate", "input": {"prompt": f"Story {i}"},
                                                "params": {**STORY, "seed": i}}).json()
            text = ""
            reader = httpx.Client(base_url=urls[(i + 1) % len(urls)], headers=headers, timeout=120)
            with reader, reader.stream("GET", f"/v1/jobs/{job['id']}/events") as response:
                event = None
                for line in response.iter_lines():
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: ") and event == "delta":
                        data = json.loads(line[6:])
                        text = text[: data["offset"]] + data["text"]
            stored = client.get(f"/v1/jobs/{job['id']}").json()
            return stored["status"] == "succeeded" and text == (stored["result"] or {}).get("text")

    with ThreadPoolExecutor(max_workers=8) as pool:
        matched = sum(pool.map(follow, range(args.streams)))
    return {"streams": args.streams, "deltas_equal_stored_text": matched,
            "share": round(matched / args.streams, 4)}


def main() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # this process holds the idle sockets
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("CLOVERQ_TEST_DATABASE_URL"))
    parser.add_argument("--redis-url", default=os.environ.get("CLOVERQ_TEST_REDIS_URL"))
    parser.add_argument("--dead", type=int, default=2000, help="jobs of the cancelled batch")
    parser.add_argument("--live", type=int, default=200, help="short bulk jobs after the resume")
    parser.add_argument("--idle", type=int, default=1100, help="idle connections to one API process")
    parser.add_argument("--max-connections", type=int, default=900)
    parser.add_argument("--idle-timeout", type=float, default=5.0)
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cloverq-defects-") as tmp:
        workdir = Path(tmp)
        with (scratch_database(args.database_url, workdir, prefix="defects") as db_url,
              scratch_redis(args.redis_url, workdir) as redis_url):
            report = run(args, workdir, db_url, redis_url)
    print(json.dumps(report, indent=2))


def run(args: argparse.Namespace, workdir: Path, db_url: str, redis_url: str) -> dict:
    from scheduler.infra.db import get_session_factory
    from worker.model.demo import write_demo_checkpoint

    checkpoint = workdir / "demo"
    write_demo_checkpoint(checkpoint, seed=0, size="tiny")
    migrate(db_url)
    with get_session_factory(db_url)() as session:
        key = create_key(session, tenant="bench", scopes={"submit", "read", "admin"}).key
    settings = Settings(database_url=db_url, redis_url=redis_url, data_dir=workdir, model_dir=checkpoint,
                        log_level="WARNING", engine_max_batch=4, engine_interactive_reserve=1,
                        tenant_max_active_jobs=10 * (args.dead + args.live),
                        queue_max_depth={"interactive": 1000, "standard": 5000, "bulk": args.dead + 100,
                                         "joint": 500},
                        max_connections=args.max_connections, idle_timeout_seconds=args.idle_timeout,
                        worker_heartbeat_seconds=0.5, reconcile_interval_seconds=1.0)
    processes: list[Worker] = []
    try:
        apis = [_start_api(settings, workdir, f"api-{i}") for i in range(2)]
        processes += [api for api, _ in apis]
        urls = [url for _, url in apis]
        workers = [_start_worker(f"worker-{i}", settings, workdir, queues="interactive,standard,bulk,joint",
                                 threads=5) for i in range(2)]
        processes += workers
        _wait_ready(workers, redis_url)
        processes.append(_start_beat(settings, workdir))
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        from scheduler.fleet.workers import list_workers

        nodes = [w.id for w in list_workers(client)]
        with httpx.Client(base_url=urls[0], headers={"Authorization": f"Bearer {key}"}, timeout=60) as api:
            report = {"stranded": stranded(settings, api, nodes, args)}
        report["streams"] = streams(urls, key, args)
        report["idle"] = idle_connections(urls[1], args)
        return report
    finally:
        for process in processes:
            process.stop()


if __name__ == "__main__":
    main()
