"""The API judges long prompts by the checkpoint it counts for (issue 26): a 16K-token contract
passes on the demo's 131,072-token context with the default settings; beyond the context, the
setting or the engine's memory a 422 names both numbers (tokens asked and the limit, or bytes
needed and available) and where the limit comes from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter

from api.errors import ApiError
from api.limits import check_job_limits
from api.prompt_tokens import PromptTokenCounter
from api.schemas.jobs import JobCreate
from scheduler.infra.settings import Settings
from scheduler.infra.settings_groups.limits import CHAT_TEMPLATE_SLACK_TOKENS
from tests.long_contract import QUESTIONS, contract

CREATE: TypeAdapter[Any] = TypeAdapter(JobCreate)
CONTRACT_TOKENS = 16_000  # a 16K-token contract; its questions keep a joint prompt within 16,384


@pytest.fixture(scope="module")
def demo(demo_checkpoint: Path) -> PromptTokenCounter:
    counter = PromptTokenCounter.from_model_dir(demo_checkpoint)
    assert counter.exact and counter.checkpoint is not None and counter.checkpoint.max_positions == 131_072
    return counter


def _count(counter: PromptTokenCounter) -> Any:
    return lambda text: counter.count([text])


def _check(body: dict[str, Any], counter: PromptTokenCounter, **settings: Any) -> dict[str, Any]:
    return check_job_limits(CREATE.validate_python(body), settings=Settings(**settings), counter=counter,
                            faults_enabled=False)


def _refusal(body: dict[str, Any], counter: PromptTokenCounter, **settings: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        _check(body, counter, **settings)
    assert caught.value.status_code == 422
    return caught.value


def _decide(context: str, mode: str) -> dict[str, Any]:
    return {"kind": "decide", "input": {"context": context, "questions": QUESTIONS, "mode": mode}}


def test_a_16k_token_contract_passes_with_the_default_settings(demo: PromptTokenCounter) -> None:
    text = contract(_count(demo), CONTRACT_TOKENS)
    assert CONTRACT_TOKENS - 60 <= demo.count([text]) <= CONTRACT_TOKENS
    _check({"kind": "generate", "input": {"prompt": text}}, demo)
    _check(_decide(text, "independent"), demo)
    _check(_decide(text, "joint"), demo)
    _check({"kind": "extract", "input": {"context": text, "schema": {"type": "object", "properties": {
        "days": {"type": "integer"}}, "required": ["days"]}}}, demo)


def test_over_the_setting_names_both_numbers_and_the_checkpoints_context(demo: PromptTokenCounter) -> None:
    text = contract(_count(demo), 16_500)
    error = _refusal({"kind": "generate", "input": {"prompt": text}}, demo)
    assert error.code == "prompt_too_long"
    assert error.details == {"prompt_tokens": demo.count([text]), "max_prompt_tokens": 16_384, "exact": True,
                             "setting": "CLOVERQ_MAX_PROMPT_TOKENS", "checkpoint_max_positions": 131_072,
                             "limited_by": "setting"}
    assert f"has {demo.count([text])} tokens; the limit is 16384 tokens" in error.message
    assert "raise CLOVERQ_MAX_PROMPT_TOKENS up to the checkpoint's 131072" in error.message


def test_over_the_checkpoints_context_the_setting_cannot_help(demo_checkpoint: Path, tmp_path: Path) -> None:
    small = tmp_path / "short-context"
    shutil.copytree(demo_checkpoint, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    counter = PromptTokenCounter.from_model_dir(small)
    text = contract(_count(counter), 1500)
    error = _refusal(_decide(text, "joint"), counter)
    assert error.code == "prompt_too_long" and error.details["limited_by"] == "checkpoint"
    assert error.details["max_prompt_tokens"] == error.details["checkpoint_max_positions"] == 1024
    assert "the limit is 1024 tokens (the checkpoint's context, max_position_embeddings" in error.message
    assert "raise CLOVERQ_MAX_PROMPT_TOKENS" not in error.message  # it would not help
    # a generated region past the context is refused too: the engine holds no more than the context
    fits = contract(_count(counter), 1000)
    body = {"kind": "generate", "input": {"prompt": fits}, "params": {"max_new_tokens": 100}}
    error = _refusal(body, counter)
    assert error.code == "request_too_long" and "the checkpoint reads 1024" in error.message


def test_beyond_the_engines_memory_names_bytes_needed_and_available(demo: PromptTokenCounter) -> None:
    text = contract(_count(demo), 1900)
    tokens = demo.count([text])
    error = _refusal({"kind": "generate", "input": {"prompt": text}, "params": {"max_new_tokens": 128}}, demo,
                     engine_max_tokens_in_flight=2000)
    assert error.code == "context_exceeds_memory"
    memory = demo.checkpoint.memory if demo.checkpoint is not None else None
    assert memory is not None
    per_position = int(memory.bytes_per_position())  # tiny Clover, float32: 2 layers x K,V x 2 heads x 16 x 4
    assert per_position == 512 and memory.state_bytes > 0
    details = error.details
    positions = tokens + CHAT_TEMPLATE_SLACK_TOKENS + 128  # the template's framing counted too
    assert details["positions"] == positions and details["max_tokens_in_flight"] == 2000
    assert details["bytes_needed"] == positions * per_position + memory.state_bytes
    assert details["bytes_available"] == 2000 * per_position
    assert f"{details['bytes_needed']:,} bytes" in error.message and "1,024,000 bytes" in error.message
    assert "CLOVERQ_ENGINE_MAX_TOKENS_IN_FLIGHT" in error.message
    # a decision's one sequence (context + its longest question) is judged the same way
    decision = _refusal(_decide(text, "independent"), demo, engine_max_tokens_in_flight=1500)
    assert decision.code == "context_exceeds_memory"
