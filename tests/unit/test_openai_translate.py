"""OpenAI request -> cloverq job body and job -> OpenAI answer (pure translation), and the OpenAI
error shape on the OpenAI-compatible paths."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from api import openai_compat as oa
from api.errors import ApiError, error_response, openai_style, param_of
from api.schemas.jobs import JobErrorInfo, JobOut, JobResult, JobTimings


def _chat(**fields: Any) -> oa.ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return oa.parse_request(oa.ChatCompletionRequest, body)


def test_chat_maps_onto_a_generate_job() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = _chat(messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}],
                max_completion_tokens=32, temperature=0.5, top_p=0.9, seed=7, steps_per_block=2, block_size=4,
                strategy="dynamic", threshold=0.8, top_k=5, step_budget=100, priority="bulk",
                metadata={"run": "x"}, user="someone", n=1, logprobs=False, tool_choice="none")
    job = oa.chat_job(req)
    assert job.kind == "generate"
    assert job.input.messages is not None
    assert [(m.role, m.content) for m in job.input.messages] == [("system", "Be brief."), ("user", "a\nb")]
    params = job.params.model_dump(exclude_none=True)
    assert params == {"max_new_tokens": 32, "temperature": 0.5, "top_p": 0.9, "seed": 7,
                      "steps_per_block": 2, "block_size": 4, "strategy": "dynamic", "threshold": 0.8,
                      "top_k": 5, "step_budget": 100}
    assert job.priority == "bulk" and job.metadata == {"run": "x"}


def test_thinking_switches() -> None:
    assert oa.chat_job(_chat(chat_template_kwargs={"enable_thinking": True})).params.thinking is True
    assert oa.chat_job(_chat(reasoning_effort="none")).params.thinking is False
    assert oa.chat_job(_chat(reasoning_effort="high")).params.thinking is True
    assert oa.chat_job(_chat(thinking=False)).params.thinking is False
    assert oa.chat_job(_chat()).params.thinking is None  # the deployment's default


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"n": 3}, "unsupported_parameter", "n"),
        ({"presence_penalty": 0.5}, "unsupported_parameter", "presence_penalty"),
        ({"functions": [{"name": "f"}]}, "unsupported_parameter", "functions"),
        ({"response_format": {"type": "xml"}}, "invalid_request", "response_format.type"),
        ({"function_call": "auto"}, "unsupported_parameter", "functions"),
        ({"messages": [{"role": "function", "content": "x"}]}, "unsupported_parameter", "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "unsupported_parameter",
         "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "unsupported_parameter",
         "messages[0].content"),
        ({"bogus": 1}, "unrecognized_argument", "bogus"),
        ({"max_tokens": 0}, "invalid_request", "max_tokens"),
        ({"max_completion_tokens": 0}, "invalid_request", "max_completion_tokens"),
        ({"temperature": -1}, "invalid_request", "temperature"),
        ({"priority": "urgent"}, "invalid_request", "priority"),
        ({"stop": ["a"] * 17}, "invalid_request", "stop"),
        ({"stream_options": {"include_usage": True}}, "invalid_request", "stream_options"),
        ({"messages": []}, "invalid_request", "messages"),
    ],
)
def test_what_cloverq_cannot_do_is_a_400_naming_the_parameter(fields: dict[str, Any], code: str,
                                                              param: str) -> None:
    with pytest.raises(ApiError) as caught:
        oa.chat_job(_chat(**fields))
    assert (caught.value.status_code, caught.value.code, caught.value.param) == (400, code, param)


def test_completions_take_one_prompt_string() -> None:
    req = oa.parse_request(oa.CompletionRequest, {"model": "m", "prompt": ["Once"], "max_tokens": 5})
    job = oa.completion_job(req)
    assert job.input.prompt == "Once" and job.params.max_new_tokens == 5
    for prompt in (["a", "b"], [[1, 2, 3]]):
        with pytest.raises(ApiError) as caught:
            oa.completion_job(oa.parse_request(oa.CompletionRequest, {"model": "m", "prompt": prompt}))
        assert caught.value.param == "prompt"


def test_limit_errors_of_the_job_api_name_the_openai_parameter() -> None:
    exc = ApiError(422, "invalid_request", "too many", [{"loc": ["body", "params", "max_new_tokens"]}])
    assert oa.openai_param(exc).param == "max_tokens"
    exc = ApiError(422, "invalid_request", "x", [{"loc": ["body", "params", "steps_per_block"]}])
    assert oa.openai_param(exc).param == "steps_per_block"
    exc = ApiError(422, "prompt_too_long", "long", {"prompt_tokens": 9})
    assert oa.openai_param(exc).param is None


def test_stop_sequences_cut_text_and_streams() -> None:
    assert oa.apply_stop("hello world", ["o w", "ld"]) == ("hell", True)
    assert oa.apply_stop("hello", ["x"]) == ("hello", False)
    scanner = oa.StopScanner(["STOP"])
    out = [scanner.feed(piece) for piece in ("abc S", "T", "xyz ST", "OP tail")]
    assert out == ["abc ", "", "STxyz ", ""] and scanner.hit
    assert scanner.flush() == ""
    quiet = oa.StopScanner(["END"])
    assert quiet.feed("the E") == "the " and quiet.flush() == "E"


def _job(status: str = "succeeded", **result: Any) -> JobOut:
    return JobOut(id="j1", kind="generate", status=status, params={"thinking": True}, model_version="m@1",
                  result=JobResult(**result) if result else None,
                  timings=JobTimings(created_at=datetime(2026, 1, 1, tzinfo=UTC)))


def test_answers_in_openai_shape() -> None:
    job = _job(text="Hello there", reasoning="Because.", finish_reason="eos",
               usage={"prompt_tokens": 3, "completion_tokens": 4, "steps_used": 8, "blocks": 2})
    chat = oa.chat_response(job, model="m", stops=[])
    assert chat["id"] == "chatcmpl-j1" and chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "Hello there",
                                             "reasoning_content": "Because."}
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert chat["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "steps_used": 8,
                             "blocks": 2}
    assert chat["created"] == int(datetime(2026, 1, 1, tzinfo=UTC).timestamp())
    cut = oa.completion_response(job, model="m", stops=[" there"], echo="Say: ")
    assert cut["choices"][0]["text"] == "Say: Hello" and cut["choices"][0]["finish_reason"] == "stop"
    assert oa.finish_reason(_job(finish_reason="budget"), False) == "length"


def test_failed_jobs_answer_errors() -> None:
    assert oa.job_failure(_job("cancelled")).status_code == 409
    failed = _job("failed").model_copy(update={"error": JobErrorInfo(code="invalid_input", message="bad")})
    assert (oa.job_failure(failed).status_code, oa.job_failure(failed).code) == (400, "invalid_input")
    broken = _job("failed").model_copy(update={"error": JobErrorInfo(code="retries_exhausted", message="x")})
    assert oa.job_failure(broken).status_code == 500


def test_openai_paths_get_openais_error_shape() -> None:
    assert openai_style("/v1/chat/completions") and openai_style("/openai/v1/batches/x")
    assert openai_style("/v1/models") and openai_style("/v1/files/f/content")
    assert not openai_style("/v1/jobs") and not openai_style("/v1/batches")
    response = error_response(422, "invalid_request", "bad", [{"loc": ["body", "messages", 0, "content"]}],
                              path="/v1/chat/completions")
    assert response.status_code == 400
    assert response.body == (b'{"error":{"message":"bad","type":"invalid_request_error",'
                             b'"param":"messages[0].content","code":"invalid_request"}}')
    own = error_response(422, "invalid_request", "bad", None, path="/v1/jobs")
    assert own.status_code == 422 and b'"details"' in own.body
    assert param_of([{"loc": ["query", "limit"]}]) == "limit" and param_of(None) is None
