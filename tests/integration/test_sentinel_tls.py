"""TLS through Sentinel (``rediss+sentinel://``) with Debian's TLS-enabled ``redis-server``.

A master, a replica and three sentinels serving TLS only (``bench/fleet_services.py``
``SentinelSet(tls=...)``: ``tls-port`` with ``port 0``, ``tls-replication yes``, the session PKI's
server certificate for 127.0.0.1). Shown here:

- cloverq's sync and asyncio clients and the Celery broker (publish and consume through cloverq's
  Sentinel channel) talk TLS to the sentinels and to the master, and follow a ``SENTINEL FAILOVER``;
- a client that trusts another CA is refused (the certificate is verified, not just encrypted);
- a whole stack on that URL (a real worker, beat and API: admission scripts, registry, pub/sub long
  poll, event stream) runs a job to its end.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_lib

from bench.fleet_services import SentinelSet, TlsFiles, free_port
from scheduler.infra.celery_app import create_celery_app
from scheduler.infra.redis_client import async_redis_from_url, redis_from_url
from scheduler.infra.settings import Settings
from tests.conftest import ProcessLauncher, wait_for
from tests.tls_servers import redis_tls_missing

pytestmark = [pytest.mark.integration, pytest.mark.skipif(redis_tls_missing() is not None,
                                                          reason=str(redis_tls_missing()))]


@pytest.fixture(scope="module")
def tls_sentinels(pki: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelSet]:
    redis_set = SentinelSet(tmp_path_factory.mktemp("tls-sentinel"),
                            tls=TlsFiles(ca_cert=pki.ca_cert, cert=pki.server_cert, key=pki.server_key))
    try:
        redis_set.start()
        yield redis_set
    finally:
        redis_set.stop()


def test_every_client_speaks_tls_to_sentinels_and_master_and_follows_a_failover(
    tls_sentinels: SentinelSet,
) -> None:
    url = tls_sentinels.url
    assert url.startswith("rediss+sentinel://")
    client = redis_from_url(url, decode_responses=True, socket_timeout=5)
    client.set("tls:sync", "1")
    connection = client.connection_pool.get_connection()
    try:
        assert type(connection).__name__ == "SentinelManagedSSLConnection"
    finally:
        client.connection_pool.release(connection)

    async def async_roundtrip(key: str, value: str = "1") -> Any:
        aclient = async_redis_from_url(url, decode_responses=True, socket_timeout=5)
        try:
            await aclient.set(key, value)
            return await aclient.get(key)
        finally:
            await aclient.aclose()

    assert asyncio.run(async_roundtrip("tls:async")) == "1"
    app = create_celery_app(Settings(redis_url=url))
    queue_name = f"tls-test-{uuid.uuid4().hex[:8]}"

    def broker_roundtrip(body: dict[str, Any]) -> Any:
        with app.connection_for_write() as connection:
            queue = connection.SimpleQueue(queue_name)
            try:
                queue.put(body)
                message = queue.get(timeout=10)
                message.ack()
                return message.payload
            finally:
                queue.close()

    assert broker_roundtrip({"n": 1}) == {"n": 1}

    old = tls_sentinels.master_port()
    took = tls_sentinels.failover()
    new = tls_sentinels.master_port()
    assert new != old

    master = next(node for node in tls_sentinels.nodes if node.port == new).client()

    def follows() -> bool:
        """A write of each client lands on the new master (the old one answers until demoted)."""
        token = uuid.uuid4().hex
        try:
            client.set("tls:after", token)
            asyncio.run(async_roundtrip("tls:async-after", token))
        except redis_lib.RedisError:
            return False
        return master.get("tls:after") == token and master.get("tls:async-after") == token

    wait_for(follows, timeout=20, interval=0.2, message="the clients to write to the new master")
    assert wait_for(lambda: _quietly(broker_roundtrip, {"n": 2}), timeout=15, interval=0.5,
                    message="the broker on the new master") == {"n": 2}
    print(f"TLS through Sentinel: failover named in {took:.2f} s, every client followed")


def _quietly(call: Callable[..., Any], *args: Any) -> Any:
    try:
        return call(*args)
    except Exception:
        return None


def test_a_client_trusting_another_ca_is_refused(tls_sentinels: SentinelSet, pki: Any) -> None:
    url = tls_sentinels.url.split("?", 1)[0] + f"?ssl_ca_certs={pki.other_ca_cert}"
    client = redis_from_url(url, socket_timeout=3)
    with pytest.raises(redis_lib.RedisError):  # no sentinel verifies: no master found
        client.ping()
    plain = redis_from_url(tls_sentinels.url.split("?", 1)[0].replace("rediss+", "redis+"), socket_timeout=3)
    with pytest.raises(redis_lib.RedisError):  # plain text to a TLS-only sentinel
        plain.ping()


def test_a_stack_on_the_tls_sentinel_url_runs_a_job(
    tls_sentinels: SentinelSet, make_settings: Callable[..., Settings], demo_checkpoint: Path, tmp_path: Path,
) -> None:
    settings = make_settings(model_dir=demo_checkpoint, redis_url=tls_sentinels.url, auth="disabled",
                             rate_limit_per_second=0)
    launcher = ProcessLauncher(tmp_path)
    port = free_port()
    try:
        worker = launcher.start_worker(settings, wait_ready=False)
        beat = launcher.start_beat(settings)
        argv = [sys.executable, "-m", "cli", "api", "--host", "127.0.0.1", "--port", str(port)]
        api = launcher._spawn(argv, settings, "api")
        launcher.wait_ready(worker, settings, timeout=120)
        base = f"http://127.0.0.1:{port}"

        def api_up() -> bool:
            assert api.proc.poll() is None, api.log()[-3000:]
            try:
                return httpx.get(f"{base}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(api_up, timeout=90, interval=0.2, message="the API")
        body = {"kind": "generate", "input": {"prompt": "The quick brown fox"},
                "params": {"max_new_tokens": 8, "steps_per_block": 2, "seed": 5}}
        answer = httpx.post(f"{base}/v1/jobs", json=body, timeout=30)
        assert answer.status_code == 202, answer.text
        job_id = answer.json()["id"]
        began = time.monotonic()
        job: dict[str, Any] = {}
        while time.monotonic() - began < 60 and job.get("status") != "succeeded":
            job = httpx.get(f"{base}/v1/jobs/{job_id}", params={"wait": 20}, timeout=40).json()
        assert job.get("status") == "succeeded", job
        events = httpx.get(f"{base}/v1/jobs/{job_id}/events", timeout=30).text  # from the job's Redis stream
        assert "event: result" in events
        assert beat.proc.poll() is None and worker.proc.poll() is None
    finally:
        launcher.close()
