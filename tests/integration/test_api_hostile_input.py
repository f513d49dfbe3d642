"""Hostile input over HTTP (issue 16) on real databases: a 4xx JSON error, and nothing stored.

Each request below answered 500 (or was stored) before: lone surrogates in text, naive or
out-of-range timestamps and cursors, deeply nested JSON and huge integers in every batch format,
NaN, over-large sampling parameters and metadata, and webhook URLs with credentials or loopback
and metadata addresses. Every one must be refused with the JSON error shape and a stable code,
with the row counts of jobs, batches and batch_jobs unchanged. A list page stays within
``list_max_response_bytes``. The pure rules are unit-tested in
``tests/unit/test_api_hostile_input.py`` and ``tests/unit/test_webhooks_ssrf.py``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.app import create_app
from api.schemas.jobs import JobList
from scheduler.batches.service import Batch, BatchJob
from scheduler.infra.db import get_session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job

pytestmark = pytest.mark.integration

JSON = {"content-type": "application/json"}
JSONL = {"content-type": "application/x-ndjson"}
DEEP = "[" * 10_000 + "]" * 10_000
BIG_INT = "7" * 5_000
GOOD_SPEC = '{"kind":"generate","input":{"prompt":"hello"},"params":{"max_new_tokens":4}}'
HUGE_METADATA = {f"k{i}": "x" * 31_000 for i in range(32)}  # ~1 MB, what the fault run stored


# One app per backend for the whole module (its start-up was ~1.7 s of each of 67 tests): every
# test sends its own requests and compares the stored rows before and after them.
@pytest.fixture(scope="module")
def api_settings(
    make_settings: Callable[..., Settings], db_backend_url: str, demo_checkpoint: Path
) -> Settings:
    return make_settings(database_url=db_backend_url, model_dir=demo_checkpoint, auth="disabled",
                         fault_injection=False, batch_max_jobs=50, tenant_max_active_jobs=100_000,
                         list_max_response_bytes=65_536)


@pytest.fixture(scope="module")
def client(api_settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(api_settings), raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture
def stored(api_settings: Settings) -> Callable[[], tuple[int, int, int]]:
    sessions = get_session_factory(api_settings.resolved_database_url)

    def counts() -> tuple[int, int, int]:
        with sessions() as session:
            return tuple(  # type: ignore[return-value]
                int(session.scalar(select(func.count()).select_from(table)) or 0)
                for table in (Job, Batch, BatchJob)
            )

    return counts


def _cursor(created: str) -> str:
    raw = f"{created}|00000000-0000-0000-0000-000000000000"
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _job(**fields: Any) -> str:
    """A job body as JSON text (``\\ud800`` escapes survive as lone surrogates when parsed)."""
    body: dict[str, Any] = {"kind": "generate", "input": {"prompt": "hello"}, "params": {"max_new_tokens": 4}}
    body.update(fields)
    return json.dumps(body)


def _decide(context: str = "doc", question: str = "ok?") -> str:
    questions = [{"id": "a", "text": question}]
    return json.dumps({"kind": "decide", "input": {"context": context, "questions": questions}})


def _batch(*specs: str, **fields: Any) -> str:
    extra = "".join(f',"{name}":{json.dumps(value)}' for name, value in fields.items())
    return '{"jobs":[' + ",".join(specs) + "]" + extra + "}"


def _multipart(file: str = GOOD_SPEC, **form: str) -> dict[str, Any]:
    return {"files": {"file": ("specs.jsonl", file.encode())}, "data": form}


def _json(content: str) -> dict[str, Any]:
    return {"content": content, "headers": JSON}


def _jsonl(content: str) -> dict[str, Any]:
    return {"content": content, "headers": JSONL}


def _query(**params: str) -> dict[str, Any]:
    return {"params": params}


NAN_SPEC = _job().replace('"max_new_tokens": 4', '"threshold": NaN')
BIG_INT_SPEC = _job().replace('"max_new_tokens": 4', f'"max_new_tokens": {BIG_INT}')
JOBS, BATCHES = "/v1/jobs", "/v1/batches"
INVALID, TOO_LARGE, WEBHOOK = "invalid_request", "metadata_too_large", "invalid_webhook_url"

# (name, method, path, request kwargs, error code); every one answers 422.
HOSTILE: list[tuple[str, str, str, dict[str, Any], str]] = [
    # lone surrogates in text (the tokenizer / UTF-8 encoding failed on them)
    ("prompt surrogate", "POST", JOBS, _json(_job(input={"prompt": "a\ud800b"})), INVALID),
    ("messages surrogate", "POST", JOBS,
     _json(_job(input={"messages": [{"role": "user", "content": "\udfff"}]})), INVALID),
    ("decide context surrogate", "POST", JOBS, _json(_decide(context="\ud800")), INVALID),
    ("decide question surrogate", "POST", JOBS, _json(_decide(question="\udc00")), INVALID),
    ("metadata key surrogate", "POST", JOBS, _json(_job(metadata={"\ud800": 1})), INVALID),
    ("strategy surrogate", "POST", JOBS, _json(_job(params={"strategy": "\ud800"})), INVALID),
    # JSON the parser refuses
    ("jobs nested 10k", "POST", JOBS, _json(DEEP), INVALID),
    ("jobs 5000-digit int", "POST", JOBS, _json(BIG_INT_SPEC), INVALID),
    ("jobs threshold NaN", "POST", JOBS, _json(NAN_SPEC), INVALID),
    # bounds and caps
    ("top_k 10**30", "POST", JOBS, _json(_job(params={"top_k": 10**30})), INVALID),
    ("seed 2**64", "POST", JOBS, _json(_job(params={"seed": 2**64})), INVALID),
    ("step_budget 10**12", "POST", JOBS, _json(_job(params={"step_budget": 10**12})), INVALID),
    ("metadata 1 MB", "POST", JOBS, _json(_job(metadata=HUGE_METADATA)), TOO_LARGE),
    # webhook targets
    ("webhook credentials", "POST", JOBS,
     _json(_job(webhook_url="https://user:secret@hooks.example.com/x")), WEBHOOK),
    ("webhook loopback", "POST", JOBS, _json(_job(webhook_url="http://127.0.0.1:8000/x")), WEBHOOK),
    ("webhook ::1", "POST", JOBS, _json(_job(webhook_url="http://[::1]:8000/x")), WEBHOOK),
    ("webhook metadata service", "POST", JOBS,
     _json(_job(webhook_url="http://169.254.169.254/latest/meta-data/")), WEBHOOK),
    ("webhook localhost", "POST", JOBS, _json(_job(webhook_url="http://localhost/x")), WEBHOOK),
    # list filters and cursors
    ("created_after naive", "GET", JOBS, _query(created_after="2024-01-01T00:00:00"), INVALID),
    ("created_before naive", "GET", JOBS, _query(created_before="2024-01-01T00:00:00"), INVALID),
    ("created_after +14:00", "GET", JOBS, _query(created_after="0001-01-01T00:00:00+14:00"), INVALID),
    ("created_before -14:00", "GET", JOBS, _query(created_before="9999-12-31T23:59:59-14:00"), INVALID),
    ("cursor naive", "GET", JOBS, _query(cursor=_cursor("2024-01-01T00:00:00")), INVALID),
    ("cursor +14:00", "GET", JOBS, _query(cursor=_cursor("0001-01-01T00:00:00+14:00")), INVALID),
    # batches: JSON body
    ("batch nested 10k", "POST", BATCHES, _json('{"jobs":' + DEEP + "}"), INVALID),
    ("batch 5000-digit int", "POST", BATCHES, _json('{"jobs":[' + BIG_INT + "]}"), INVALID),
    ("batch threshold NaN", "POST", BATCHES, _json(_batch(NAN_SPEC)), INVALID),
    ("batch strategy surrogate", "POST", BATCHES,
     _json(_batch(GOOD_SPEC, _job(params={"strategy": "\ud800"}))), INVALID),
    ("batch prompt surrogate", "POST", BATCHES, _json(_batch(GOOD_SPEC, _job(input={"prompt": "\ud800"}))),
     INVALID),
    ("batch spec top_k", "POST", BATCHES, _json(_batch(_job(params={"top_k": 10**30}))), INVALID),
    ("batch spec metadata too large", "POST", BATCHES,
     _json(_batch(GOOD_SPEC, _job(metadata={"k": "x" * 20_000}))), INVALID),
    ("batch metadata too large", "POST", BATCHES, _json(_batch(GOOD_SPEC, metadata={"k": "x" * 20_000})),
     TOO_LARGE),
    ("batch metadata surrogate", "POST", BATCHES, _json(_batch(GOOD_SPEC, metadata={"k": "\ud800"})),
     INVALID),
    ("batch webhook credentials", "POST", BATCHES,
     _json(_batch(GOOD_SPEC, webhook_url="https://u:p@hooks.example.com/")), WEBHOOK),
    ("batch spec webhook loopback", "POST", BATCHES, _json(_batch(_job(webhook_url="http://127.0.0.1:9/"))),
     INVALID),
    # batches: JSONL lines
    ("jsonl nested 10k", "POST", BATCHES, _jsonl(GOOD_SPEC + "\n" + DEEP), INVALID),
    ("jsonl 5000-digit int", "POST", BATCHES, _jsonl(GOOD_SPEC + "\n" + BIG_INT), INVALID),
    ("jsonl NaN", "POST", BATCHES, _jsonl(NAN_SPEC), INVALID),
    ("jsonl surrogate", "POST", BATCHES, _jsonl(_job(input={"prompt": "\ud800"})), INVALID),
    ("jsonl webhook credentials", "POST", BATCHES + "?webhook_url=https://u:p@hooks.example.com/",
     _jsonl(GOOD_SPEC), WEBHOOK),
    # batches: multipart metadata and file
    ("multipart metadata nested 10k", "POST", BATCHES, _multipart(metadata=DEEP), INVALID),
    ("multipart metadata 5000-digit int", "POST", BATCHES, _multipart(metadata='{"a":' + BIG_INT + "}"),
     INVALID),
    ("multipart metadata NaN", "POST", BATCHES, _multipart(metadata='{"a":NaN}'), INVALID),
    ("multipart metadata not JSON", "POST", BATCHES, _multipart(metadata="{nope"), INVALID),
    ("multipart metadata too large", "POST", BATCHES, _multipart(metadata=json.dumps({"k": "x" * 20_000})),
     TOO_LARGE),
    ("multipart file nested 10k", "POST", BATCHES, _multipart(file=DEEP), INVALID),
    ("multipart webhook loopback", "POST", BATCHES, _multipart(webhook_url="http://[::1]:9/"), WEBHOOK),
]


@pytest.mark.parametrize(("method", "path", "kwargs", "code"),
                         [case[1:] for case in HOSTILE], ids=[case[0] for case in HOSTILE])
def test_hostile_input_is_a_4xx_json_error_and_nothing_is_stored(
    client: TestClient, stored: Callable[[], tuple[int, int, int]],
    method: str, path: str, kwargs: dict[str, Any], code: str,
) -> None:
    before = stored()
    response = client.request(method, path, **kwargs)
    assert response.status_code == 422, response.text[:500]
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}
    assert body["error"]["code"] == code, body
    assert stored() == before


def test_the_same_requests_without_the_hostile_part_are_stored(
    api_settings: Settings, stored: Callable[[], tuple[int, int, int]]
) -> None:
    """The control: the cases above fail for the hostile part, not for how they are sent. Its
    stored job's webhook is a loopback address (allow-listed for this app only): a later beat sweep
    in this session may try to deliver it, and nothing may leave this machine."""
    settings = api_settings.replaced(webhook_allowed_networks=["127.0.0.0/8"])
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        _post_the_control_requests(client, stored)


def _post_the_control_requests(client: TestClient, stored: Callable[[], tuple[int, int, int]]) -> None:
    before = stored()
    assert client.post("/v1/jobs", content=_job(input={"prompt": "a\U0001f600b"}, metadata={"k": "v"},
                                                 webhook_url="http://127.0.0.1:9/x"),
                       headers=JSON).status_code == 202
    assert client.post("/v1/jobs", content=_decide(), headers=JSON).status_code == 202
    assert client.post("/v1/batches", content=_batch(GOOD_SPEC, metadata={"k": 1}),
                       headers=JSON).status_code == 202
    assert client.post("/v1/batches", content=GOOD_SPEC + "\n" + GOOD_SPEC, headers=JSONL).status_code == 202
    assert client.post("/v1/batches", **_multipart(metadata='{"run": 1}')).status_code == 202
    jobs, batches, members = stored()
    assert (jobs - before[0], batches - before[1], members - before[2]) == (6, 3, 4)
    since = client.get("/v1/jobs", params={"created_after": "2024-01-01T00:00:00Z", "limit": 1})
    assert since.status_code == 200 and len(since.json()["items"]) == 1


def test_a_list_page_stays_within_the_response_byte_bound(client: TestClient, api_settings: Settings) -> None:
    since = datetime.now(UTC).isoformat()  # other tests share the database: page only ours
    metadata = {"blob": "m" * 15_000}  # just under max_metadata_bytes
    created = []
    for _ in range(9):
        response = client.post("/v1/jobs", content=_job(metadata=metadata), headers=JSON)
        assert response.status_code == 202, response.text
        created.append(response.json()["id"])
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 200, "created_after": since}
        if cursor:
            params["cursor"] = cursor
        response = client.get("/v1/jobs", params=params)
        assert response.status_code == 200
        assert len(response.content) <= api_settings.limits.list_max_response_bytes
        page = JobList.model_validate(response.json())  # the documented shape
        assert page.items and all(item.metadata == metadata for item in page.items)
        seen += [item.id for item in page.items]
        pages += 1
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == list(reversed(created))  # every job once, newest first
    assert pages >= 3  # 9 x ~15 KB over 64 KB pages
