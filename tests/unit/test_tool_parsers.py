"""Tool calls through the chat template and back: the demo template renders tools and calls as
Hugging Face's apply_chat_template does (Qwen3 XML), and each call format's parser reads the exact
text its template writes back into the same calls, typed by the tool's schema."""

from __future__ import annotations

import json
from typing import Any

import pytest

from scheduler.jobs.tool_spec import parse_tools
from worker.model.demo_tokenizer import CHAT_TEMPLATE, build_demo_tokenizer
from worker.model.tokenizer import Tokenizer
from worker.structured.tool_parsers import ParsedCall, call_format, parse_calls
from worker.structured.tool_render import call_id, openai_calls, template_messages

PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "ratio": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
        "unit": {"enum": ["C", "F"]},
        "note": {"type": ["string", "null"]},
    },
    "required": ["city"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": PARAMETERS}},
         {"type": "function", "function": {"name": "now",
                                           "parameters": {"type": "object", "properties": {}}}}]
CALLS = [ParsedCall("get_weather", {"city": "New York\nNY", "days": 3, "metric": False, "ratio": 0.5,
                                    "tags": ["a", "b"], "where": {"lat": 40.7}, "unit": "F", "note": None}),
         ParsedCall("now", {})]
SPEC = parse_tools(TOOLS, "auto", max_tools=8)

# The assistant-turn part of Qwen3's (hermes) chat template, verbatim in what it renders.
HERMES_TEMPLATE = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}"
    "{{- tool_call.arguments | tojson }}{%- endif %}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
    "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
)


def _tokenizer(template: str) -> Tokenizer:
    return Tokenizer(build_demo_tokenizer(512), chat_template=template, mask_token_id=0, eos_token_ids=(1,),
                     pad_token_id=2)


def _assistant_text(template: str, content: str, calls: list[ParsedCall]) -> str:
    """What the template writes for an assistant turn with ``calls`` (the model's answer)."""
    messages = template_messages([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": content, "tool_calls": openai_calls(calls, "job")},
    ])
    text = _tokenizer(template).render_chat(messages, enable_thinking=False, add_generation_prompt=False,
                                            tools=TOOLS)
    return text.rsplit("<|im_start|>assistant", 1)[1].removeprefix("\n").removesuffix("<|im_end|>\n")


def test_the_demo_template_renders_like_hugging_faces_apply_chat_template() -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=build_demo_tokenizer(512),
                                              eos_token="<|im_end|>")
    hf.chat_template = CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": openai_calls(CALLS, "j")},
                {"role": "tool", "tool_call_id": call_id("j", 0), "content": "sunny"},
                {"role": "tool", "tool_call_id": call_id("j", 1), "content": "noon"}]
    ours = _tokenizer(CHAT_TEMPLATE).render_chat(template_messages(messages), enable_thinking=False,
                                                 tools=TOOLS)
    theirs = hf.apply_chat_template(template_messages(messages), tools=TOOLS, tokenize=False,
                                    add_generation_prompt=True, enable_thinking=False)
    assert ours == theirs
    assert ours.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in ours
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n" \
           "</tool_response><|im_end|>\n" in ours
    # without tools nothing changes: the trained demo's prompts are the ones it was trained on
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert _tokenizer(CHAT_TEMPLATE).render_chat(plain, enable_thinking=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        "<think>\n\n</think>\n\n")


def test_the_call_format_comes_from_the_template() -> None:
    assert call_format(CHAT_TEMPLATE) == "qwen3_xml"
    assert call_format(HERMES_TEMPLATE) == "hermes"
    assert call_format("{{ messages }}") is None and call_format(None) is None


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, HERMES_TEMPLATE], ids=["qwen3_xml", "hermes"])
def test_each_parser_reads_back_what_its_template_writes(template: str) -> None:
    fmt = call_format(template)
    assert fmt is not None
    text = _assistant_text(template, "Checking.", CALLS)
    assert "<tool_call>" in text and ("<function=get_weather>" in text) == (fmt == "qwen3_xml")
    parsed = parse_calls(text, SPEC, fmt)
    assert parsed.malformed is None
    assert parsed.content == "Checking."
    assert parsed.calls == CALLS  # typed by the schema: int, bool, float, list, object, enum, null
    only_calls = parse_calls(_assistant_text(template, "", CALLS[:1]), SPEC, fmt)
    assert only_calls.content == "" and only_calls.calls == CALLS[:1]


def test_xml_values_follow_the_schema() -> None:
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
            "<parameter=days>\n7\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
            "<parameter=unit>\nC\n</parameter>\n<parameter=note>\nnull\n</parameter>\n</function>\n</tool_call>")
    (call,) = parse_calls(text, SPEC, "qwen3_xml").calls
    assert call.arguments == {"city": "42", "days": 7, "metric": True, "unit": "C", "note": None}


def test_xml_values_follow_a_referenced_schema() -> None:
    """pydantic writes an enum or a nested model as a $ref into $defs (``pydantic_function_tool``):
    the value is typed by the subschema referred to, and validated against it."""
    parameters = {"$defs": {"Unit": {"enum": ["c", "f"], "type": "string"},
                            "Days": {"type": "integer", "minimum": 1, "maximum": 14},
                            "Where": {"type": "object", "properties": {"city": {"type": "string"}},
                                      "required": ["city"]}},
                  "type": "object", "required": ["unit", "days", "where"],
                  "properties": {"unit": {"$ref": "#/$defs/Unit", "description": "scale"},
                                 "days": {"$ref": "#/$defs/Days"}, "where": {"$ref": "#/$defs/Where"}}}
    spec = parse_tools([{"type": "function", "function": {"name": "forecast", "parameters": parameters}}],
                       "auto", max_tools=8)
    text = ("<tool_call>\n<function=forecast>\n<parameter=unit>\nf\n</parameter>\n<parameter=days>\n5\n"
            "</parameter>\n<parameter=where>\n{\"city\": \"Rome\"}\n</parameter>\n</function>\n</tool_call>")
    (call,) = parse_calls(text, spec, "qwen3_xml").calls
    assert call.arguments == {"unit": "f", "days": 5, "where": {"city": "Rome"}}
    late = text.replace("\n5\n", "\n15\n")  # over the referenced maximum
    assert not parse_calls(late, spec, "qwen3_xml").calls


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("<tool_call>\n<function=nope>\n</function>\n</tool_call>", "not one of the tools"),
        ("<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
         "do not validate"),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n",
         "never closed"),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\nthree"
         "\n</parameter>\n</function>\n</tool_call>", "is not integer"),
        ("<tool_call>\nget_weather(city='Rome')\n</tool_call>", "no <function="),
    ],
)
def test_a_malformed_call_leaves_the_whole_answer_as_content(text: str, why: str) -> None:
    parsed = parse_calls("Sure. " + text, SPEC, "qwen3_xml")
    assert parsed.calls == [] and parsed.content == ("Sure. " + text).strip()
    assert parsed.malformed is not None and why in parsed.malformed
    # the reason goes to the logs: it names the rule broken, never the model's text
    assert not any(word in parsed.malformed for word in ("nope", "Rome", "three"))


def test_hermes_malformed_and_text_arguments() -> None:
    spec = parse_tools(TOOLS, "auto", max_tools=8)
    text = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>'
    assert parse_calls(text, spec, "hermes").calls == [ParsedCall("get_weather", {"city": "Oslo"})]
    bad = parse_calls('<tool_call>\n{"name": "get_weather", "arguments": {\n</tool_call>', spec, "hermes")
    assert bad.calls == [] and bad.malformed is not None and "not JSON" in bad.malformed


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = _assistant_text(CHAT_TEMPLATE, "", CALLS)
    single = parse_tools(TOOLS, "auto", False, max_tools=8)
    assert parse_calls(text, single, "qwen3_xml").calls == CALLS[:1]


def test_calls_in_openais_shape_have_stable_ids_and_json_arguments() -> None:
    (first, second) = openai_calls(CALLS, "job-1")
    assert first["id"] == call_id("job-1", 0) != second["id"] and first["id"].startswith("call_")
    assert first["type"] == "function" and first["function"]["name"] == "get_weather"
    assert json.loads(first["function"]["arguments"]) == CALLS[0].arguments
    assert openai_calls(CALLS, "job-1") == [first, second]


def test_template_messages_give_templates_the_arguments_as_a_mapping() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "assistant", "content": "", "tool_calls": openai_calls(CALLS, "j")}]
    (turn,) = template_messages(messages)
    assert turn["tool_calls"][0]["function"]["arguments"] == CALLS[0].arguments
    assert isinstance(messages[0]["tool_calls"][0]["function"]["arguments"], str)  # the input is untouched
