"""Tool calling through the official ``openai`` client, unchanged, against a running stack (API
over HTTP, a real worker on the tiny random demo of each family, Clover and SDAR): a two-turn
tool loop, a named ``tool_choice`` whose arguments validate under ``jsonschema``, and a streamed
named call whose reassembled deltas equal the non-streamed call. Random weights carry no meaning, so the calls
come from ``required`` / named choices (valid by construction); ``auto`` is parsed best effort."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from scheduler.infra.settings import Settings
from tests.integration import test_openai_compat as compat
from tests.integration.test_openai_compat import Stack

pytestmark = pytest.mark.integration

QUICK = {"block_size": 4, "steps_per_block": 2}

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["C", "F"]},
        "alerts": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]


@pytest.fixture(scope="module", params=["clover", "sdar"])
def stack(request: pytest.FixtureRequest, make_settings: Callable[..., Settings],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """API + worker on each demo family in turn (the family's checkpoint renders the tools)."""
    family_fixture = "demo_checkpoint" if request.param == "clover" else "sdar_checkpoint"
    checkpoint: Path = request.getfixturevalue(family_fixture)
    with compat.running_stack(make_settings, checkpoint, tmp_path_factory) as running:
        yield running


def _create(stack: Stack, **kwargs: Any) -> Any:
    return stack.openai().chat.completions.create(model=stack.model, tools=TOOLS, temperature=0.7, seed=3,
                                                  extra_body=QUICK, **kwargs)


def test_a_two_turn_tool_loop(stack: Stack) -> None:
    first = _create(stack, messages=ASK, tool_choice="required")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    job = stack.job(first.id.removeprefix("chatcmpl-"))  # the cloverq job behind it
    assert job["status"] == "succeeded" and job["result"]["tool_calls"][0]["id"] == call.id

    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    final = _create(stack, messages=history, max_tokens=8)  # auto: the model may answer or call again
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls  # random weights
    assert isinstance(answer.message.content, str)
    rendered = stack.job(final.id.removeprefix("chatcmpl-"))
    assert rendered["status"] == "succeeded"
    # the call and the tool's result were rendered into the second prompt (same tools section)
    assert rendered["result"]["usage"]["prompt_tokens"] > job["result"]["usage"]["prompt_tokens"] + 20


def test_a_named_call_validates_and_streams_the_same_call(stack: Stack) -> None:
    reply = _create(stack, messages=ASK, tool_choice=NAMED)
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    chunks = list(_create(stack, messages=ASK, tool_choice=NAMED, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert {d.index for d in deltas} == {0}
    name = "".join(d.function.name or "" for d in deltas if d.function)
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert (name, arguments) == (call.function.name, call.function.arguments)  # same seed, same call
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""


def test_a_bad_tool_is_a_400_and_stores_nothing(stack: Stack) -> None:
    import openai

    before = len(stack.jobs_with("bad-tool"))
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}}}}]
    with pytest.raises(openai.BadRequestError) as caught:
        stack.openai().chat.completions.create(model=stack.model, messages=ASK, tools=bad,
                                               metadata={"probe": "bad-tool"})
    assert (caught.value.code, caught.value.param) == ("unsupported_schema_keyword",
                                                       "tools[0].function.parameters")
    assert len(stack.jobs_with("bad-tool")) == before
