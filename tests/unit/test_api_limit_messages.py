"""Limit errors name the setting that raises them and, for documents, what to do instead (issue
33: a long contract got "A decision prompt has 37873 tokens (bound); the limit is 4096")."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast
from unittest.mock import MagicMock

import pytest
import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import TypeAdapter
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from api.body_limit import BodyLimitMiddleware
from api.errors import ApiError, install_error_handlers
from api.limit_messages import admission_refused
from api.limits import check_job_limits
from api.prompt_tokens import PromptTokenCounter
from api.routes.batches import _validate_specs
from api.schemas.jobs import JobCreate
from scheduler.access.admission import Admission, AdmissionRefused
from scheduler.infra.settings import Settings, flat_fields

create = TypeAdapter(JobCreate)


@pytest.fixture
def words(tmp_path: Path) -> PromptTokenCounter:
    """An exact counter: one token per word (a real tokenizers.json, WordLevel)."""
    tokenizer = Tokenizer(WordLevel({"[UNK]": 0, "clause": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    counter = PromptTokenCounter.from_model_dir(tmp_path)
    assert counter.exact
    return counter


def _refusal(body: dict[str, Any], counter: PromptTokenCounter, **settings: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        check_job_limits(create.validate_python(body), settings=Settings(**settings), counter=counter,
                         faults_enabled=False)
    return caught.value


def _decision(context: str, *, mode: str, questions: int = 20) -> dict[str, Any]:
    asked = [{"id": f"q{i}", "text": f"clause {i} applies?"} for i in range(questions)]
    return {"kind": "decide", "input": {"context": context, "mode": mode, "questions": asked}}


def test_a_joint_decision_over_the_limit_names_the_setting_and_offers_independent_mode(
    words: PromptTokenCounter,
) -> None:
    error = _refusal(_decision("clause " * 90, mode="joint"), words, max_prompt_tokens=100)
    assert error.code == "prompt_too_long" and error.status_code == 422
    assert "CLOVERQ_MAX_PROMPT_TOKENS" in error.message
    assert error.details["setting"] == "CLOVERQ_MAX_PROMPT_TOKENS"
    assert "(bound)" not in error.message and "UTF-8" not in error.message  # counted exactly
    assert f"has {error.details['prompt_tokens']} tokens; the limit is 100 tokens" in error.message
    assert 'mode "independent"' in error.message and error.details["independent_prompt_tokens"] <= 100
    assert "split the context" in error.message


def test_a_document_too_long_for_any_mode_says_into_how_many_parts_to_split_it(
    words: PromptTokenCounter,
) -> None:
    error = _refusal(_decision("clause " * 450, mode="independent"), words, max_prompt_tokens=100)
    assert "independent" not in error.message.split("Instead:")[1]  # it is independent already
    assert "split the context into 5 or more parts" in error.message
    assert "POST /v1/batches" in error.message


def test_the_byte_bound_says_it_is_an_upper_bound() -> None:
    error = _refusal({"kind": "generate", "input": {"prompt": "x" * 50}}, PromptTokenCounter(None),
                     max_prompt_tokens=10)
    assert "at most 50 tokens (counted as UTF-8 bytes, an upper bound" in error.message
    assert error.details["exact"] is False


HI = {"kind": "generate", "input": {"prompt": "hi"}}

# A refusal as the client sees it: its message and its details.
Refusal = tuple[str, Any]


def _job(body: dict[str, Any]) -> Callable[[], Refusal]:
    """A job spec refused by ``check_job_limits`` (POST /v1/jobs and each spec of a batch)."""
    def refuse() -> Refusal:
        error = _refusal(body, PromptTokenCounter(None))
        return error.message, error.details
    return refuse


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def _structured(schema: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "generate", "input": {"prompt": "hi", "response_schema": schema}}


def _body_limit(path: str) -> Refusal:
    """A 2 KiB body on ``path`` through the API's body-limit middleware (1 KiB; batch uploads 1.5 KiB)."""
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=1024, path_limits={"/v1/batches": 1536})
    response = TestClient(app).post(path, content=b"x" * 2048, headers={"content-type": "application/json"})
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "body_too_large"
    return error["message"], error["details"]


def _batch_of(jobs: int, **settings: Any) -> Refusal:
    with pytest.raises(ApiError) as caught:
        _validate_specs([HI] * jobs, settings=Settings(**settings), counter=PromptTokenCounter(None))
    assert (caught.value.status_code, caught.value.code) == (422, "batch_too_large")
    return caught.value.message, caught.value.details


class _ScriptRedis:
    """A Redis stand-in whose admission script answers ``reply`` (the scripts themselves run on a
    real Redis in tests/integration/test_admission_*)."""

    def __init__(self, reply: list[Any]) -> None:
        self.reply = reply

    def register_script(self, lua: str) -> Callable[..., list[Any]]:
        return lambda keys, args: self.reply

    def pipeline(self, transaction: bool = True) -> MagicMock:
        return MagicMock()


def _admission(reply: list[Any], *, active_jobs: int = 0, **settings: Any) -> ApiError:
    """The API's 429 for what the admission script answered (``Admission.check_batch``)."""
    admission = Admission(cast(redis.Redis, _ScriptRedis(reply)), Settings(**settings))
    with pytest.raises(AdmissionRefused) as refused:
        admission.check_batch(tenant="t", jobs={"bulk": ["m1", "m2"]}, active_jobs=active_jobs)
    error = admission_refused(refused.value)
    assert error.status_code == 429 and error.headers == {"Retry-After": "5"}
    return error


# The script's reply: admitted, refused queue, depth, cap, tenant override, reservations, admissions.
QUEUE_FULL = [0, 1, 20_000, 20_000, b"", 0, 0]
TENANT_FULL = [1, 0, 0, 0, b"", 2, 2]


def _queue_full() -> Refusal:
    error = _admission(QUEUE_FULL)
    return error.message, error.details


def _tenant_full() -> Refusal:
    error = _admission(TENANT_FULL, active_jobs=1_000)
    return error.message, error.details


@pytest.mark.parametrize(
    ("refuse", "setting"),
    [(_job({**HI, "params": {"max_new_tokens": 99_999}}), "max_new_tokens_limit"),
     (_job({**HI, "params": {"step_budget": 99_999}}), "max_step_budget"),
     (_job({**HI, "params": {"steps_per_block": 65, "block_size": 128}}), "max_steps_per_block"),
     (_job({**HI, "metadata": {"note": "x" * 17_000}}), "max_metadata_bytes"),
     (_job(_decision("clause", mode="joint", questions=65)), "decide_max_questions"),
     (_job({"kind": "decide", "input": {"context": "c", "questions": [
         {"id": "q", "text": "q", "choices": [str(i) for i in range(17)]}]}}), "decide_max_choices"),
     (_job({"kind": "decide", "input": {"context": "c" * 200_001, "questions": [{"id": "q", "text": "q"}]}}),
      "decide_max_context_chars"),
     (_job(_structured({"type": "string", "description": "x" * 17_000})), "max_schema_bytes"),
     (_job(_structured(_nested(8))), "max_schema_depth"),
     (_job({"kind": "generate", "input": {"messages": [{"role": "user", "content": "hi"}], "tools": [
         {"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}}), "max_tools"),
     (lambda: _body_limit("/v1/jobs"), "max_body_bytes"),
     (lambda: _body_limit("/v1/batches"), "batch_max_body_bytes"),
     (lambda: _batch_of(3, batch_max_jobs=2), "batch_max_jobs"),
     (_queue_full, "queue_max_depth"),
     (_tenant_full, "tenant_max_active_jobs")],
)
def test_every_limit_error_names_its_setting(refuse: Callable[[], Refusal], setting: str) -> None:
    message, details = refuse()
    env = flat_fields()[setting].env
    assert env in message
    details = details if isinstance(details, list) else [details]
    assert details[0]["setting"] == env


def test_an_over_large_body_says_what_to_send_instead() -> None:
    message, details = _body_limit("/v1/jobs")
    assert "larger than 1024 bytes (CLOVERQ_MAX_BODY_BYTES)" in message and details["max_body_bytes"] == 1024
    assert "split it into parts, one job each" in message and "POST /v1/batches" in message
    message, details = _body_limit("/v1/batches")
    assert "larger than 1536 bytes (CLOVERQ_BATCH_MAX_BODY_BYTES)" in message
    assert "split the jobs into several batches" in message and details["max_body_bytes"] == 1536


def test_an_over_large_batch_says_into_how_many_batches_to_split_it() -> None:
    message, details = _batch_of(25, batch_max_jobs=10)
    assert message.startswith("A batch holds at most 10 jobs (CLOVERQ_BATCH_MAX_JOBS); this one has 25.")
    assert "split it into 3 or more batches of at most 10 jobs" in message
    assert details == {"jobs": 25, "max_jobs": 10, "setting": "CLOVERQ_BATCH_MAX_JOBS"}


def test_a_full_queue_or_tenant_says_to_retry_and_which_cap_refused() -> None:
    full = _admission(QUEUE_FULL)
    assert full.code == "queue_full"
    assert full.message.startswith("The bulk queue is full (20000 waiting, cap 20000). The cap is CLOVERQ_"
                                   "QUEUE_MAX_DEPTH. Instead: retry after 5 s (the Retry-After header)")
    assert full.details == {"queue": "bulk", "depth": 20_000, "max_depth": 20_000,
                            "setting": "CLOVERQ_QUEUE_MAX_DEPTH"}
    overridden = _admission([0, 1, 7, 7, b"", 0, 0])  # a cap other than the setting's: an override
    assert "The cap is an operator override of CLOVERQ_QUEUE_MAX_DEPTH." in overridden.message
    assert "raise the override (PATCH /v1/admin/limits queue_max_depth.bulk)" in overridden.message
    tenant = _admission(TENANT_FULL, active_jobs=1_000)
    assert tenant.code == "tenant_limit"
    assert "(cap 1000). The cap is CLOVERQ_TENANT_MAX_ACTIVE_JOBS." in tenant.message
    assert "retry after 5 s (the Retry-After header), or once some of the tenant's jobs have finished" in (
        tenant.message)
    assert "raise CLOVERQ_TENANT_MAX_ACTIVE_JOBS (or override it at runtime: PATCH /v1/admin/limits" in (
        tenant.message)
    assert tenant.details["setting"] == "CLOVERQ_TENANT_MAX_ACTIVE_JOBS"
    per_tenant = _admission([1, 0, 0, 0, b"3", 2, 2], active_jobs=3)  # the tenant's override: cap 3
    assert "(cap 3). The cap is an operator override of CLOVERQ_TENANT_MAX_ACTIVE_JOBS" in per_tenant.message


def test_a_schema_over_a_limit_says_what_to_send_instead() -> None:
    error = _refusal(_structured(_nested(8)), PromptTokenCounter(None))
    assert (error.status_code, error.code) == (400, "schema_too_large")
    assert "nesting deeper than 6 (CLOVERQ_MAX_SCHEMA_DEPTH). Instead: a flatter schema" in error.message
    error = _refusal(_structured({"type": "string", "description": "x" * 17_000}), PromptTokenCounter(None))
    assert "; the limit is 16384 bytes (CLOVERQ_MAX_SCHEMA_BYTES). Instead: a smaller schema" in error.message


def test_a_request_that_overflows_the_engine_says_what_would_fit() -> None:
    error = _refusal({"kind": "generate", "input": {"prompt": "x" * 40}, "params": {"max_new_tokens": 100}},
                     PromptTokenCounter(None), engine_max_len=64)
    assert error.code == "request_too_long" and "CLOVERQ_ENGINE_MAX_LEN" in error.message
    assert "lower max_new_tokens to at most 24" in error.message
