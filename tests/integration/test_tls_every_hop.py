"""TLS on every hop at once: ``cloverq api`` serving HTTPS on split planes (mutual TLS on the admin
plane), a real worker, both over a TLS-only ``redis-server`` and a PostgreSQL with ``ssl=on``
(``sslmode=verify-full``), all started by the test from a CA it made: a job submitted over HTTPS
succeeds, and the admin plane answers only a client with a certificate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.orm import sessionmaker

from scheduler.access.api_keys import create_key
from scheduler.infra.db import make_engine, migrate
from scheduler.infra.settings import Settings
from tests.conftest import ProcessLauncher, wait_for
from tests.integration.test_api_planes import client_from, start_api


def test_a_job_over_tls_on_the_api_redis_and_postgresql(
        launcher: ProcessLauncher, make_settings: Callable[..., Settings], demo_checkpoint: Any, pki: Any,
        tls_redis: Any, tls_postgres: Any) -> None:
    database_url = tls_postgres.url()
    migrate(database_url)
    engine = make_engine(database_url)
    with engine.connect() as connection:  # the server itself says the session is encrypted
        assert connection.execute(text("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")).scalar()
    with sessionmaker(engine)() as session:
        submitter = create_key(session, tenant="tls-tenant").key
        operator = create_key(session, tenant="tls-ops", scopes=["admin"]).key
    engine.dispose()
    settings = make_settings(database_url=database_url, redis_url=tls_redis.url(3), model_dir=demo_checkpoint,
                             tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
                             admin_tls_client_ca_file=pki.ca_cert)
    launcher.start_worker(settings)
    _, urls = start_api(launcher, settings)

    ca = str(pki.ca_cert)
    with client_from("127.0.0.1", verify=ca, headers={"Authorization": f"Bearer {submitter}"}) as client:
        body = {"kind": "generate", "input": {"prompt": "Hello"}, "params": {"max_new_tokens": 8}}
        submitted = client.post(urls["public"] + "/v1/jobs", json=body)
        assert submitted.status_code == 202, submitted.text
        job_url = f"{urls['public']}/v1/jobs/{submitted.json()['id']}"

        def finished() -> dict[str, Any] | None:
            job: dict[str, Any] = client.get(job_url, params={"wait": 5}).json()
            return job if job["status"] in ("succeeded", "failed", "cancelled") else None

        job = wait_for(finished, timeout=120, interval=0.1, message="the job over TLS")
        assert job["status"] == "succeeded", job
        assert job["result"]["token_ids"]
        assert client.get(urls["ops"] + "/readyz").status_code == 200  # database + Redis over TLS
    operator_auth = {"Authorization": f"Bearer {operator}"}
    no_certificate = client_from("127.0.0.1", verify=ca, headers=operator_auth)
    with no_certificate as client, pytest.raises(httpx.TransportError):
        client.get(urls["admin"] + "/v1/admin/workers")
    client_cert = (str(pki.client_cert), str(pki.client_key))
    with client_from("127.0.0.1", verify=ca, cert=client_cert, headers=operator_auth) as mutual:
        workers = mutual.get(urls["admin"] + "/v1/admin/workers")
        assert workers.status_code == 200 and workers.json()["items"], workers.text
