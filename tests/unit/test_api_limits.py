"""Request models and deployment limits of ``POST /v1/jobs`` (pure logic)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import TypeAdapter, ValidationError
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from api.errors import ApiError
from api.limits import check_generate_limits
from api.prompt_tokens import PromptTokenCounter
from api.schemas.jobs import GenerateJobCreate, JobCreate
from scheduler.infra.settings import Settings

create = TypeAdapter(JobCreate)


def _body(**overrides: object) -> GenerateJobCreate:
    raw: dict[str, object] = {"kind": "generate", "input": {"prompt": "hello"}}
    raw.update(overrides)
    return create.validate_python(raw)


def _settings(**overrides: object) -> Settings:
    return Settings(**overrides)  # type: ignore[arg-type]


def test_defaults_are_filled_in_from_settings() -> None:
    settings = _settings(default_max_new_tokens=77, default_steps_per_block=3)
    params = check_generate_limits(_body(), settings=settings, counter=PromptTokenCounter(None),
                                   faults_enabled=False)
    assert params["max_new_tokens"] == 77
    assert params["steps_per_block"] == 3
    assert "seed" not in params and "strategy" not in params  # unset optional knobs are not stored


def test_unset_decoding_knobs_are_left_to_the_model_family() -> None:
    params = check_generate_limits(_body(), settings=_settings(), counter=PromptTokenCounter(None),
                                   faults_enabled=False)
    assert not {"steps_per_block", "strategy", "threshold"} & set(params)  # the worker's family defaults


@pytest.mark.parametrize(
    ("field", "value", "limit_name"),
    [("max_new_tokens", 5000, "max_new_tokens_limit"),
     ("steps_per_block", 65, "max_steps_per_block"),
     ("step_budget", 9000, "max_step_budget")],
)
def test_params_over_the_limits_are_rejected(field: str, value: int, limit_name: str) -> None:
    settings = _settings()
    with pytest.raises(ApiError) as caught:
        check_generate_limits(_body(params={field: value}), settings=settings,
                              counter=PromptTokenCounter(None), faults_enabled=False)
    assert caught.value.status_code == 422
    assert caught.value.code == "invalid_request"
    assert caught.value.details[0]["loc"] == ["body", "params", field]
    assert str(getattr(settings.limits, limit_name)) in caught.value.message


def test_fault_knob_is_refused_unless_enabled() -> None:
    body = _body(params={"fault": "always_fail"})
    with pytest.raises(ApiError):
        check_generate_limits(body, settings=_settings(), counter=PromptTokenCounter(None),
                              faults_enabled=False)
    params = check_generate_limits(body, settings=_settings(), counter=PromptTokenCounter(None),
                                   faults_enabled=True)
    assert params["fault"] == "always_fail"


def test_byte_bound_never_admits_a_prompt_over_the_limit() -> None:
    settings = _settings(max_prompt_tokens=10)
    counter = PromptTokenCounter(None)
    check_generate_limits(_body(input={"prompt": "x" * 10}), settings=settings, counter=counter,
                          faults_enabled=False)
    with pytest.raises(ApiError) as caught:
        check_generate_limits(_body(input={"prompt": "é" * 6}), settings=settings, counter=counter,
                              faults_enabled=False)  # 6 characters, 12 UTF-8 bytes
    assert caught.value.code == "prompt_too_long"
    assert caught.value.details["exact"] is False


def _word_tokenizer(path: Path) -> Path:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def test_tokenizer_counts_exactly_across_chat_messages(tmp_path: Path) -> None:
    counter = PromptTokenCounter.from_model_dir(_word_tokenizer(tmp_path / "model"))
    assert counter.exact
    settings = _settings(max_prompt_tokens=4)
    messages = [{"role": "system", "content": "hello world"}, {"role": "user", "content": "hello world"}]
    check_generate_limits(_body(input={"messages": messages}), settings=settings, counter=counter,
                          faults_enabled=False)
    messages.append({"role": "user", "content": "hello"})
    with pytest.raises(ApiError) as caught:
        check_generate_limits(_body(input={"messages": messages}), settings=settings, counter=counter,
                              faults_enabled=False)
    assert caught.value.details == {"prompt_tokens": 5, "max_prompt_tokens": 4, "exact": True,
                                    "setting": "CLOVERQ_MAX_PROMPT_TOKENS"}


def test_missing_or_broken_tokenizer_falls_back_to_the_byte_bound(tmp_path: Path) -> None:
    assert not PromptTokenCounter.from_model_dir(tmp_path / "absent").exact
    (tmp_path / "tokenizer.json").write_text(json.dumps({"not": "a tokenizer"}))
    assert not PromptTokenCounter.from_model_dir(tmp_path).exact


@pytest.mark.parametrize(
    "raw",
    [
        {"kind": "generate", "input": {}},  # neither prompt nor messages
        {"kind": "generate", "input": {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}},
        {"kind": "generate", "input": {"messages": []}},
        {"kind": "generate", "input": {"messages": [{"role": "robot", "content": "b"}]}},
        {"kind": "generate", "input": {"prompt": "a"}, "params": {"temprature": 0.5}},  # typo
        {"kind": "generate", "input": {"prompt": "a"}, "params": {"strategy": "random"}},
        {"kind": "generate", "input": {"prompt": "a"}, "params": {"top_p": 0}},
        {"kind": "generate", "input": {"prompt": "a"}, "params": {"max_new_tokens": 0}},
        {"kind": "generate", "input": {"prompt": "a"}, "priority": "urgent"},
        {"kind": "generate", "input": {"prompt": "a"}, "webhook_url": "not a url"},
        {"kind": "summarise", "input": {"prompt": "a"}},
        {"input": {"prompt": "a"}},
        {"kind": "generate", "input": {"prompt": "nul \u0000 inside"}},  # PostgreSQL cannot store it
        {"kind": "generate", "input": {"messages": [{"role": "user", "content": "\u0000"}]}},
        {"kind": "generate", "input": {"prompt": "a"}, "metadata": {"k": "\u0000"}},
    ],
)
def test_invalid_bodies_are_rejected(raw: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        create.validate_python(raw)


def test_a_full_body_is_accepted() -> None:
    body = _body(
        input={"messages": [{"role": "user", "content": "hi"}]},
        params={"max_new_tokens": 16, "block_size": 4, "steps_per_block": 2, "strategy": "dynamic",
                "threshold": 0.8, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 1,
                "step_budget": 12, "thinking": True},
        priority="bulk",
        metadata={"user": "u1", "n": 3},
        webhook_url="https://example.com/hook",
    )
    assert body.params.strategy == "dynamic"
    assert body.input.text_parts() == ["hi"]
