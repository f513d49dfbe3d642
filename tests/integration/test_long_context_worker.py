"""A 16K-token contract decided end to end (issue 26): the real API (which reads the demo
checkpoint's 131,072-token context next to its tokenizer) and a real worker on the tiny demo, with
the default limits that ``cloverq up`` runs with. Its route counts the prompt, so it is not an
interactive job; what the deployment cannot hold is a 422 that names both numbers and stores nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.app import create_app
from scheduler.infra.db import make_engine
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job
from tests.conftest import ProcessLauncher, wait_for
from tests.long_contract import QUESTIONS, contract
from worker.model.tokenizer import Tokenizer

pytestmark = pytest.mark.integration

CONTRACT_TOKENS = 16_000  # with its questions within the default 16,384-token cap


@pytest.fixture(scope="module")
def stack(make_settings: Callable[..., Settings], demo_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, TestClient]]:
    settings = make_settings(model_dir=demo_checkpoint, auth="disabled")  # the default limits
    launcher = ProcessLauncher(tmp_path_factory.mktemp("long-context-logs"))
    try:
        launcher.start_worker(settings, queues="interactive,standard,bulk", concurrency=2)
        with TestClient(create_app(settings)) as client:
            yield settings, client
    finally:
        launcher.close()


@pytest.fixture(scope="module")
def text(demo_checkpoint: Path) -> str:
    tokenizer = Tokenizer.from_dir(demo_checkpoint)
    return contract(lambda t: len(tokenizer.encode(t)), CONTRACT_TOKENS)


def _stored(settings: Settings) -> int:
    with make_engine(settings.resolved_database_url).connect() as conn:
        return int(conn.execute(select(func.count()).select_from(Job)).scalar_one())


def test_a_16k_token_contract_is_decided(stack: tuple[Settings, TestClient], text: str) -> None:
    _, client = stack
    body = {"kind": "decide", "input": {"context": text, "questions": QUESTIONS, "mode": "independent"}}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["queue"] == "standard"  # 16K prompt tokens at prefill_token_cost each: not interactive

    def done() -> dict[str, Any] | None:
        current = client.get(f"/v1/jobs/{job['id']}").json()
        return current if current["status"] not in ("queued", "running") else None

    final = wait_for(done, timeout=120, interval=0.2, message="the 16K-token decision")
    assert final["status"] == "succeeded", final
    assert [a["id"] for a in final["result"]["answers"]] == [q["id"] for q in QUESTIONS]
    assert final["progress"]["prompt_tokens"] >= 2 * CONTRACT_TOKENS  # both questions' sequences hold it


def test_a_long_prompt_with_a_short_output_is_routed_by_its_prefill(stack: tuple[Settings, TestClient],
                                                                     text: str) -> None:
    _, client = stack
    prompt = text[: len(text) // 4]  # ~4K tokens, 8 new: interactive before issue 26
    response = client.post("/v1/jobs", json={"kind": "generate", "input": {"prompt": prompt},
                                             "params": {"max_new_tokens": 8}})
    assert response.status_code == 202, response.text
    assert response.json()["queue"] == "standard"


def test_what_the_deployment_cannot_hold_is_a_422_naming_both_numbers(
    stack: tuple[Settings, TestClient], text: str
) -> None:
    settings, client = stack
    before = _stored(settings)
    too_long = client.post("/v1/jobs", json={"kind": "generate", "input": {"prompt": text + text[:2000]}})
    assert too_long.status_code == 422
    error = too_long.json()["error"]
    assert error["code"] == "prompt_too_long" and error["details"]["max_prompt_tokens"] == 16_384
    assert error["details"]["checkpoint_max_positions"] == 131_072
    small = settings.replaced(engine_max_tokens_in_flight=8192)  # an API for a smaller engine
    with TestClient(create_app(small)) as narrow:
        refused = narrow.post("/v1/jobs", json={"kind": "generate", "input": {"prompt": text}})
    assert refused.status_code == 422
    error = refused.json()["error"]
    assert error["code"] == "context_exceeds_memory"
    assert error["details"]["bytes_needed"] > error["details"]["bytes_available"] == 8192 * 512
    assert _stored(settings) == before  # nothing stored for either
