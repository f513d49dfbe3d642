"""Batch uploads are bounded in memory (issue 31, item 6).

A 63.4 MiB JSONL body raised the API's RSS by 294 MB (4.6x) and three at once by 729 MB: the body
was decoded whole, split into a list of lines, then parsed. Now it is parsed line by line from the
bytes, and an API process parses at most ``batch_max_concurrent_uploads`` at once (the next waits
``batch_upload_wait_seconds``, then gets a retryable 503).
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable

import anyio
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.routes.batches import _parse_jsonl
from scheduler.infra.settings import Settings

pytestmark = pytest.mark.integration


def test_parsing_a_jsonl_upload_costs_about_its_parsed_size() -> None:
    line = json.dumps({"kind": "generate", "input": {"prompt": "Clause " + "x" * 4000}}) + "\n"
    body = (line * 1000).encode()  # ~4 MiB
    tracemalloc.start()
    try:
        specs = _parse_jsonl(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(specs) == 1000
    assert peak < 1.6 * len(body), f"parsing took {peak / len(body):.2f}x the body"  # was 3.2x


def test_an_upload_past_the_concurrent_bound_is_refused_with_a_retryable_503(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings(auth="disabled", batch_max_concurrent_uploads=1, batch_upload_wait_seconds=0.2)
    app = create_app(settings)
    with TestClient(app) as client:
        body = {"jobs": [{"kind": "generate", "input": {"prompt": "x"}}]}
        app.state.batch_uploads = anyio.Semaphore(0, max_value=1)  # the one slot is taken
        busy = client.post("/v1/batches", json=body)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "uploads_busy", busy.text
        assert busy.headers["retry-after"] == "2"
        app.state.batch_uploads = anyio.Semaphore(1)  # free again
        assert client.post("/v1/batches", json=body).status_code == 202
