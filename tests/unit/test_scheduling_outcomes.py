"""Job <-> engine mapping in the worker: params with defaults, prompts, outcome per finish reason."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler.infra.settings import Settings
from scheduler.jobs.models import JobStatus
from scheduler.jobs.retry import InputJobError
from worker.engine.types import FinishReason, GenerationResult
from worker.execution import prompt_ids
from worker.job_handler import outcome_of, sampling_params

SETTINGS = Settings(default_max_new_tokens=64, default_steps_per_block=3)


class FakeTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def render_chat(self, messages: list[dict[str, Any]], *, enable_thinking: bool,
                    add_generation_prompt: bool = True) -> str:
        if any("content" not in m for m in messages):
            raise ValueError("message without content")
        body = "|".join(f"{m['role']}:{m['content']}" for m in messages)
        return f"{body}|T" if enable_thinking else body


def result(reason: FinishReason, ids: list[int] | None = None, error: str | None = None) -> GenerationResult:
    ids = ids if ids is not None else [104, 105]
    return GenerationResult(request_id="r", token_ids=ids, finish_reason=reason, steps_used=7, blocks=2,
                            tokens=len(ids), prompt_tokens=5, error=error)


def test_sampling_params_fill_deployment_defaults_and_keep_given_values() -> None:
    p = sampling_params({"temperature": 0.5, "seed": 9, "thinking": True, "fault": "x"}, SETTINGS)
    assert (p.max_new_tokens, p.steps_per_block, p.temperature, p.seed) == (64, 3, 0.5, 9)
    assert sampling_params({"max_new_tokens": 5, "step_budget": 4}, SETTINGS).step_budget == 4


def test_prompt_text_or_chat_messages_with_thinking_switch() -> None:
    tok = FakeTokenizer()
    assert prompt_ids({"prompt": "ab"}, {}, tok) == [97, 98]
    messages = [{"role": "user", "content": "x"}]
    assert tok.decode(prompt_ids({"messages": messages}, {"thinking": True}, tok)) == "user:x|T"
    assert tok.decode(prompt_ids({"messages": messages}, {}, tok)) == "user:x"
    with pytest.raises(InputJobError):
        prompt_ids({}, {}, tok)
    with pytest.raises(InputJobError):
        prompt_ids({"messages": [{"role": "user"}]}, {}, tok)


@pytest.mark.parametrize(("reason", "status", "code"), [
    (FinishReason.EOS, JobStatus.SUCCEEDED, None),
    (FinishReason.LENGTH, JobStatus.SUCCEEDED, None),
    (FinishReason.BUDGET, JobStatus.SUCCEEDED, None),
    (FinishReason.CANCELLED, JobStatus.CANCELLED, None),
    (FinishReason.DEADLINE, JobStatus.FAILED, "deadline_exceeded"),
])
def test_outcome_per_finish_reason(reason: FinishReason, status: JobStatus, code: str | None) -> None:
    outcome = outcome_of(result(reason), FakeTokenizer())
    assert outcome.status is status and outcome.error_code == code
    assert outcome.result is not None
    assert outcome.result["text"] == "hi" and outcome.result["token_ids"] == [104, 105]
    assert outcome.result["finish_reason"] == reason.value
    assert outcome.result["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "steps_used": 7,
                                       "blocks": 2}
    assert outcome.steps_used == 7


def test_an_engine_input_error_fails_without_a_result() -> None:
    outcome = outcome_of(result(FinishReason.ERROR, [], error="prompt too long"), FakeTokenizer())
    assert outcome.status is JobStatus.FAILED and outcome.error_code == "invalid_input"
    assert outcome.result is None and outcome.error_message == "prompt too long"
