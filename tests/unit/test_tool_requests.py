"""Tools at the API (pure logic): OpenAI's tools, tool_choice and tool turns translated to the
generate job, and a bad tool list refused at submit with a stable code naming the parameter."""

from __future__ import annotations

import json
from typing import Any

import pytest

from api import openai_compat as oa
from api.errors import ApiError
from api.limits import check_generate_limits
from api.prompt_tokens import PromptTokenCounter
from api.schemas.jobs import GenerateJobCreate
from scheduler.infra.settings import Settings

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city"], "additionalProperties": False}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def _job(**fields: Any) -> GenerateJobCreate:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return oa.chat_job(oa.parse_request(oa.ChatCompletionRequest, body))


def _submitted(**fields: Any) -> ApiError | None:
    """The 400 a chat request with ``fields`` gets at submit (OpenAI parameter named), or None."""
    settings = Settings(max_tools=2)
    try:
        check_generate_limits(_job(**fields), settings=settings, counter=PromptTokenCounter(None),
                              faults_enabled=False)
    except ApiError as exc:
        return oa.openai_param(exc)
    return None


def test_tools_choice_and_tool_turns_become_the_jobs_input() -> None:
    job = _job(messages=HISTORY, tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False)
    stored = job.input.model_dump(exclude_none=True)
    assert stored["tools"] == [WEATHER] and stored["tool_choice"] == "auto"
    assert stored["parallel_tool_calls"] is False
    assistant, tool = stored["messages"][1:]
    assert assistant == {"role": "assistant", "content": "", "tool_calls": HISTORY[1]["tool_calls"]}
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert _submitted(messages=HISTORY, tools=[WEATHER], tool_choice="auto") is None
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert _submitted(tools=[WEATHER], tool_choice=named) is None
    assert _submitted(tools=[WEATHER], tool_choice="required") is None


def test_the_tools_count_towards_the_prompt() -> None:
    plain = _job().input.text_parts()
    with_tools = _job(tools=[WEATHER]).input.text_parts()
    assert len(with_tools) == len(plain) + 1 and "get_weather" in with_tools[-1]
    assert _job(tools=[WEATHER], tool_choice="none").input.text_parts() == plain  # not rendered


def _renamed(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {**WEATHER["function"], "name": name}}


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"tools": [_renamed("get weather")]}, "invalid_tool_name", "tools[0].function.name"),
        ({"tools": [_renamed("x" * 65)]}, "invalid_tool_name", "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "invalid_tool_name", "tools[1].function.name"),
        ({"tools": [_renamed("a"), _renamed("b"), _renamed("c")]}, "too_many_tools", "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "unknown_tool", "tool_choice.function.name"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "invalid_tool_choice", "tool_choice"),
        ({"tool_choice": "required"}, "invalid_tool_choice", "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "invalid_tools", "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "^a"}}}}}]},
         "unsupported_schema_keyword", "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "invalid_schema", "tools[0].function.parameters"),
    ],
)
def test_a_bad_tool_list_is_a_400_with_a_stable_code(fields: dict[str, Any], code: str, param: str) -> None:
    error = _submitted(**fields)
    assert error is not None and (error.status_code, error.code, error.param) == (400, code, param)


def test_an_unsupported_keyword_names_itself_and_its_path() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "^a"}}}}}
    error = _submitted(tools=[tool])
    assert error is not None
    (detail,) = error.details
    assert detail["loc"] == ["body", "input", "tools", 0, "function", "parameters"]
    assert (detail["keyword"], detail["path"]) == ("pattern", "#/properties/a/pattern")


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}],
         "messages"),
        ([{"role": "assistant", "content": "", "tool_calls": "c"}], "messages[0].tool_calls"),
    ],
)
def test_a_malformed_tool_turn_is_a_400(messages: list[dict[str, Any]], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        _job(messages=messages)
    assert caught.value.status_code == 400 and caught.value.param is not None
    assert caught.value.param.startswith(param)


def test_calls_in_a_finished_job_are_answered_in_openais_shape() -> None:
    from api.schemas.jobs import JobOut

    calls = [{"id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                                "arguments": json.dumps({"city": "Rome"})}}]
    job = JobOut.model_validate({
        "id": "j1", "kind": "generate", "status": "succeeded", "timings": {},
        "result": {"text": "", "finish_reason": "eos", "tool_calls": calls}})
    reply = oa.chat_response(job, model="m", stops=[])
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": calls}
    assert oa.tool_call_deltas(calls) == [{"index": 0, **calls[0]}]


def test_the_stream_holds_content_from_the_first_call_on() -> None:
    hold = oa.ToolCallHold(stops=[])
    raw = "\nLet me check.\n\n<tool_call>\n<function=get_weather>\n"
    sent = "".join(hold.feed(raw[:k]) for k in range(1, len(raw) + 1))
    assert sent == "Let me check."  # no leading or trailing whitespace, nothing of the call
    assert hold.feed(raw + "<parameter=city>\nRome") == ""
    assert hold.finish("Let me check.") == ""
    # a partial tag is held, then sent when it turns out to be text
    hold = oa.ToolCallHold(stops=[])
    assert hold.feed("a <tool") == "a"
    assert hold.feed("a <tool> b") == " <tool> b"
    assert hold.finish("a <tool> b then") == " then"
